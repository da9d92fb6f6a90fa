"""The processes `stoker bench pd` starts: one `stoker serve` for the alone and
colocated configurations, and for the split one a prefill and a decode worker
pinned with taskset plus sglang-router `--pd-disaggregation` in front of them.

Every server listens on 127.0.0.1 with a key database of its own (open mode:
the user's keys would close the servers to the bench), so the decode worker
pulls only from the peer it is given with `--kv-peers`."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from stoker.bench.prefix_restart import BenchError, free_port
from stoker.bench.server_ready import wait_until_ready

CONFIGS = ("alone", "colocated", "split")
STOP_TIMEOUT_S = 60.0


def parse_cpus(spec: str, flag: str) -> list[int]:
    """A taskset -c list ("0", "0-3", "0,2") as CPU numbers."""
    cpus: list[int] = []
    try:
        for part in spec.split(","):
            low, _, high = part.strip().partition("-")
            cpus += range(int(low), int(high or low) + 1)
    except ValueError:
        raise BenchError(f"{flag} {spec!r}: expected a CPU list such as 0, 0-3 or 0,2") from None
    if not cpus or min(cpus) < 0:
        raise BenchError(f"{flag} {spec!r}: expected a CPU list such as 0, 0-3 or 0,2")
    return sorted(set(cpus))


class Child:
    """One process the bench started, its output in a log file."""

    def __init__(self, name: str, argv: Sequence[str], work: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = work / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(list(argv), stdout=log, stderr=subprocess.STDOUT, env=env)

    def why_not(self, reason: str) -> str:
        """One line: the reason and the log's last line (a server's refusal says what was wrong)."""
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        return f"{self.name} {reason}" + (f": {lines[-1].strip()[:300]}" if lines else "")

    def stop(self) -> None:
        self.terminate()
        self.wait()

    def terminate(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait(self) -> None:
        """Until the process has exited; killed after STOP_TIMEOUT_S."""
        try:
            self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class StokerServer(Child):
    def __init__(self, name: str, args: argparse.Namespace, work: Path, flags: list[str], pin: list[int]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        serve = [sys.executable, "-m", "stoker.cli", "serve", "--host", "127.0.0.1", "--port", str(self.port)]
        if args.model:
            serve += ["--model", args.model]
        taskset = ["taskset", "-c", ",".join(map(str, pin))] if pin else []
        env = {**os.environ, "STOKER_DB": str(work / f"{name}.db")}
        super().__init__(name, [*taskset, *serve, *flags, *shlex.split(args.serve_args)], work, env)

    def wait_ready(self, timeout: float) -> str | None:
        why = wait_until_ready(self.url, self.proc, timeout, interval=0.2)
        return None if why is None else self.why_not(why)


class Router(Child):
    """sglang-router in PD mode in front of one prefill and one decode worker."""

    def __init__(self, binary: str, prefill: StokerServer, kv_port: int, decode: StokerServer, work: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [
            binary, "launch", "--host", "127.0.0.1", "--port", str(self.port), "--pd-disaggregation",
            "--prefill", prefill.url, str(kv_port), "--decode", decode.url, "--policy", "round_robin",
            # its Prometheus port defaults to 29000 on every interface: a free one on loopback
            "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
        ]  # fmt: skip
        super().__init__("router", argv, work)

    def wait_ready(self, timeout: float) -> str | None:
        """None once /readiness answers 200 (the router has registered both workers);
        sglang-router serves no /ready."""
        why = wait_until_ready(self.url, self.proc, timeout, interval=0.2, path="/readiness")
        return None if why is None else self.why_not(why)


@dataclass
class Deployment:
    """Where one configuration's load goes."""

    url: str
    server_url: str
    """A stoker server of it (for /v1/models and /tokenize, which the router does not serve)."""
    children: list[Child] = field(default_factory=list)
    workers: dict[str, str] = field(default_factory=dict)
    """The split's stoker servers by role ("prefill", "decode"): their /metrics count the KV moved."""


def router_binary(args: argparse.Namespace) -> str | None:
    beside = Path(sys.executable).parent / "sglang-router"
    return args.router or (str(beside) if beside.exists() else shutil.which("sglang-router"))


def split_blocker(args: argparse.Namespace) -> str | None:
    """Why the split configuration cannot run on this machine; None when it can."""
    if shutil.which("taskset") is None:
        return "no taskset on PATH (util-linux)"
    binary = router_binary(args)
    if binary is None or not os.access(binary, os.X_OK):
        return (
            f"no sglang-router executable ({binary or 'not beside this Python nor on PATH'}): pip install sglang-router"
        )
    prefill, decode = parse_cpus(args.prefill_cpus, "--prefill-cpus"), parse_cpus(args.decode_cpus, "--decode-cpus")
    if set(prefill) & set(decode):
        return f"--prefill-cpus {args.prefill_cpus} and --decode-cpus {args.decode_cpus} overlap"
    usable = os.sched_getaffinity(0)
    missing = sorted(set(prefill + decode) - usable)
    if missing:
        return f"CPU {','.join(map(str, missing))} is not available here (usable: {','.join(map(str, sorted(usable)))})"
    return None


def start_deployments(
    args: argparse.Namespace, configs: list[str], work: Path
) -> tuple[dict[str, Deployment], dict[str, str]]:
    """The configurations' processes, started together and waited for; the ones that
    could not start are named in the second dict with one line each."""
    started: list[Child] = []
    try:
        return _start(args, configs, work, started)
    except BaseException:  # interrupted while waiting: nothing left running
        stop_all({"started": Deployment("", "", started)})
        raise


def _start(
    args: argparse.Namespace, configs: list[str], work: Path, started: list[Child]
) -> tuple[dict[str, Deployment], dict[str, str]]:
    deployments: dict[str, Deployment] = {}
    skipped: dict[str, str] = {}
    colocated = [c for c in configs if c != "split"]
    both = prefill = decode = None
    if colocated:  # --role both is the default: the colocated server is started as any user starts one
        both = StokerServer("both", args, work, [], [])
        started.append(both)
    kv_port = free_port()
    blocker = split_blocker(args) if "split" in configs else None
    if blocker is not None:
        skipped["split"] = blocker
    elif "split" in configs:
        prefill_cpus = parse_cpus(args.prefill_cpus, "--prefill-cpus")
        decode_cpus = parse_cpus(args.decode_cpus, "--decode-cpus")
        prefill_flags = ["--role", "prefill", "--kv-transfer-port", str(kv_port)]
        prefill = StokerServer(
            "prefill", args, work, [*prefill_flags, "--num-threads", str(len(prefill_cpus))], prefill_cpus
        )
        started.append(prefill)
        decode_flags = ["--role", "decode", "--kv-peers", f"127.0.0.1:{kv_port}"]
        decode = StokerServer(
            "decode", args, work, [*decode_flags, "--num-threads", str(len(decode_cpus))], decode_cpus
        )
        started.append(decode)
    if both is not None:
        why = both.wait_ready(args.ready_timeout)
        if why is None:
            deployments.update(dict.fromkeys(colocated, Deployment(both.url, both.url, [both])))
        else:
            both.stop()
            skipped.update(dict.fromkeys(colocated, why))
    if prefill is not None and decode is not None:
        why = prefill.wait_ready(args.ready_timeout) or decode.wait_ready(args.ready_timeout)
        split: list[Child] = [prefill, decode]
        if why is None:
            router = Router(str(router_binary(args)), prefill, kv_port, decode, work)
            started.append(router)
            split.insert(0, router)
            why = router.wait_ready(args.ready_timeout)
            if why is None:
                workers = {"prefill": prefill.url, "decode": decode.url}
                deployments["split"] = Deployment(router.url, decode.url, split, workers)
        if why is not None:
            stop_all({"split": Deployment("", "", split)})
            skipped["split"] = why
    return deployments, skipped


def stop_all(deployments: dict[str, Deployment]) -> None:
    """Every process signalled first, then waited for: they drain side by side."""
    children = list({id(c): c for d in deployments.values() for c in d.children}.values())
    for child in children:
        child.terminate()
    for child in children:
        child.wait()
