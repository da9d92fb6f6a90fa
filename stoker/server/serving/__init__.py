"""The generation plumbing every API shares; each API's route file holds only
its translation (its body into a Job, the Job's outputs into its shapes).

  prompt.py    a body's prompt, token budget and sampling parameters; a chat's job
  job.py       the Job: its engine requests, folded outputs, usage, finished record
  generate.py  one attempt: admission, running the job, the answer or its
               server-sent events (and the client leaving mid-way), the finished
               hooks (one exit); the Renderer an API writes with
  logprobs.py  token logprobs as the OpenAI-shaped APIs write them
"""

from typing import Any

JSONObject = dict[str, Any]
"""A JSON object as an API writes it (a body, an event, a part of one): its
values are whatever that API's schema says, which Python cannot name."""
