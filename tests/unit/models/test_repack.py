"""The background repacking (quant/repack.py) stops between two layers when asked,
as it is at process exit: a process that left while the thread was inside the packer
or torch aborted ("terminate called without an active exception")."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import torch
from gguf import GGMLQuantizationType as T

from stoker.models.quant.blocks import random_blocks
from stoker.models.quant.kernels import ggml_pack
from stoker.models.quant.repack import BackgroundRepack
from stoker.models.quant.weights import GGMLLinear, GGMLTensor, deferred_packing


def _layers(count: int) -> list[GGMLLinear]:
    with deferred_packing() as linears:
        for seed in range(count):
            blocks = torch.from_numpy(random_blocks(T.Q4_K, 64, 256, seed=seed))
            GGMLLinear([GGMLTensor(blocks, T.Q4_K, 256)])
    return linears


def test_stop_leaves_the_layers_not_reached_on_their_blocks() -> None:
    if ggml_pack(torch.from_numpy(random_blocks(T.Q4_K, 32, 256, seed=0)), T.Q4_K) is None:
        return  # no packing on this path: nothing deferred
    linears = _layers(6)
    assert len(linears) == 6
    installed: list[GGMLLinear] = []
    first_installed, go_on = threading.Event(), threading.Event()

    def on_installed(linear: GGMLLinear) -> None:
        installed.append(linear)
        first_installed.set()
        go_on.wait(10)

    repack = BackgroundRepack(linears, threading.Lock(), on_installed)
    repack.start()
    assert first_installed.wait(10)
    stopping = threading.Thread(target=repack.stop)
    stopping.start()
    while not repack._stopping.is_set():  # stop() has asked; the thread is between layers next
        pass
    go_on.set()
    stopping.join(10)
    assert not stopping.is_alive() and not repack.pending
    assert installed == linears[:1]
    assert all(part.packed is not None for part in linears[0].parts)
    assert all(part.packed is None for linear in linears[1:] for part in linear.parts)
    x = torch.randn(3, 256)
    assert torch.equal(linears[1](x), GGMLLinear([linears[1].parts[0].blocks()])(x))


def test_a_process_that_exits_while_repacking_exits_cleanly() -> None:
    """Many layers, then exit at once: the thread is stopped and waited for at exit."""
    here = str(Path(__file__).parent)
    code = (
        f"import sys; sys.path.insert(0, {here!r})\n"
        "import threading\n"
        "from test_repack import _layers\n"
        "from stoker.models.quant.repack import BackgroundRepack\n"
        "BackgroundRepack(_layers(200), threading.Lock(), lambda linear: None).start()\n"
    )
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
        assert done.returncode == 0, done.stderr[-2000:]
