"""The Lua scripts of RedisRateLimiter (control/store.py). Each runs atomically
in Redis, so replicas sharing one Redis never race on a key's limits. Numbers
cross as strings ('%.17g'): Redis would truncate a returned Lua number to an
integer. `now` is '' for Redis's own clock (TIME), or a test's clock.
"""

_PRELUDE = """
local function clock(arg)
  if arg ~= '' then return tonumber(arg) end
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
-- A bucket refilled to now, or nil without a limit; a missing bucket, or one
-- kept under other limits, is full.
local function load(key, cap, sig, now, period)
  if cap <= 0 then return nil end
  local h = redis.call('HMGET', key, 'tokens', 'updated', 'sig')
  local b = {key = key, cap = cap, rate = cap / period, tokens = cap, updated = now}
  if h[1] and h[3] == sig then
    b.tokens = tonumber(h[1])
    b.updated = tonumber(h[2])
    if now > b.updated then
      b.tokens = math.min(cap, b.tokens + (now - b.updated) * b.rate)
      b.updated = now
    end
  end
  return b
end
local function save(b, sig)
  redis.call('HSET', b.key, 'tokens', string.format('%.17g', b.tokens),
             'updated', string.format('%.17g', b.updated), 'sig', sig)
  -- Capped at a year (a debt beyond is forgotten); %d: PEXPIRE refuses 1e+20.
  local ms = math.min(math.ceil((b.cap - b.tokens) / b.rate * 1000) + 1000, 31536000000)
  redis.call('PEXPIRE', b.key, string.format('%d', ms))
end
local function fmt(x) return string.format('%.17g', x) end
"""

# KEYS: requests bucket, tokens bucket, leases
# ARGV: now ('' = Redis TIME), rpm, tpm, max concurrent (0 = none), cost, lease id ('<id>.<slots>'), lease ttl,
#       sig, period, slots (one per prompt of the request)
# Returns {outcome ('ok', 'too_large', 'too_many_prompts', 'concurrency', 'requests', 'tokens'), wait, slots in flight, then per bucket: capacity, tokens, seconds to full ('' without it)}.
ACQUIRE = (
    _PRELUDE
    + """
local now = clock(ARGV[1])
local cost, maxc, ttl, sig, period = tonumber(ARGV[5]), tonumber(ARGV[4]), tonumber(ARGV[7]), ARGV[8], tonumber(ARGV[9])
local slots = tonumber(ARGV[10])
local req = load(KEYS[1], tonumber(ARGV[2]), sig, now, period)
local tok = load(KEYS[2], tonumber(ARGV[3]), sig, now, period)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', fmt(now))
local in_flight = 0
if maxc > 0 then
  -- A lease holds the slots its id ends with (at most max concurrent leases are here).
  for _, m in ipairs(redis.call('ZRANGE', KEYS[3], 0, -1)) do
    in_flight = in_flight + (tonumber(string.match(m, '%.(%d+)$')) or 1)
  end
end
local outcome, wait = 'ok', 0
if tok and cost > tok.cap then
  -- No wait would admit it (the bucket never goes into debt at admission).
  outcome = 'too_large'
elseif maxc > 0 and slots > maxc then
  outcome = 'too_many_prompts'
elseif maxc > 0 and in_flight + slots > maxc then
  outcome = 'concurrency'
else
  for _, w in ipairs({{req, 1, 'requests'}, {tok, cost, 'tokens'}}) do
    local b = w[1]
    if b then
      local missing = w[2] - b.tokens
      if missing > 1e-9 and missing / b.rate > wait then outcome, wait = w[3], missing / b.rate end
    end
  end
end
if outcome == 'ok' then
  if req then req.tokens = req.tokens - 1; save(req, sig) end
  if tok then tok.tokens = tok.tokens - cost; save(tok, sig) end
  redis.call('ZADD', KEYS[3], fmt(now + ttl), ARGV[6])
  redis.call('PEXPIRE', KEYS[3], string.format('%d', math.ceil(ttl * 1000) + 1000))
  in_flight = in_flight + slots
end
local out = {outcome, fmt(wait), tostring(in_flight)}
for _, b in ipairs({req or false, tok or false}) do
  if b then
    table.insert(out, fmt(b.cap)); table.insert(out, fmt(b.tokens)); table.insert(out, fmt((b.cap - b.tokens) / b.rate))
  else
    table.insert(out, ''); table.insert(out, ''); table.insert(out, '')
  end
end
return out
"""
)

# KEYS: requests bucket, tokens bucket, leases
# ARGV: now, rpm, tpm, lease id, refund the request (0/1), tokens to give back (negative: charge), sig, period
RELEASE = (
    _PRELUDE
    + """
local now, sig, period = clock(ARGV[1]), ARGV[7], tonumber(ARGV[8])
redis.call('ZREM', KEYS[3], ARGV[4])
local req = load(KEYS[1], tonumber(ARGV[2]), sig, now, period)
if req and ARGV[5] == '1' then req.tokens = math.min(req.cap, req.tokens + 1); save(req, sig) end
local give = tonumber(ARGV[6])
local tok = load(KEYS[2], tonumber(ARGV[3]), sig, now, period)
if tok and give ~= 0 then tok.tokens = math.min(tok.cap, tok.tokens + give); save(tok, sig) end
return 1
"""
)

# KEYS: leases. ARGV: now, lease id, ttl. Only a lease still there is renewed: one
# released meanwhile (or expired) must not come back.
RENEW = """
local now = ARGV[1]
if now == '' then local t = redis.call('TIME'); now = tonumber(t[1]) + tonumber(t[2]) / 1000000 end
local n = redis.call('ZADD', KEYS[1], 'XX', 'CH', string.format('%.17g', tonumber(now) + tonumber(ARGV[3])), ARGV[2])
redis.call('PEXPIRE', KEYS[1], string.format('%d', math.ceil(tonumber(ARGV[3]) * 1000) + 1000))
return n
"""
