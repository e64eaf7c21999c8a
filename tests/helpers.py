"""Test helpers: run an enabled model with an explicit SparseCache and record every selection made."""

from __future__ import annotations

import itertools
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import sparsekv
from sparsekv.cache import SparseCache
from sparsekv.hf_compat import cache_kwargs
from sparsekv.registry import get_method_class

# Without a GPU the kernels run under the CPU interpreter, which needs TRITON_INTERPRET=1 before triton is first
# imported: a kernel test file then runs again in a child pytest with that variable set (one extra process).
RUN_HERE = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
here = pytest.mark.skipif(not RUN_HERE, reason="runs in the interpreter subprocess")


def run_under_interpreter(test_file: str) -> None:
    """Runs `test_file`'s tests in a child pytest under TRITON_INTERPRET=1; fails with the child's output."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1")
    env.pop("PYTEST_XDIST_WORKER", None)  # the child is a plain pytest run of its own, without workers ("-n 0")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root / "src"), str(root), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", test_file],
        # the interpreter runs every kernel on a 2-core CI machine: its files take minutes, one of them near 15
        check=False, cwd=root, env=env, capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


class Recorder:
    """Records (layer, selection mask, visible, budgets) of every sparse attention call of a cache."""

    def __init__(self, cache: SparseCache):
        self.calls: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []
        record = cache.stats.record

        def spy(layer_idx, selection, visible):
            self.calls.append((layer_idx, selection.to_mask(visible.shape[-1]), visible, selection.counts()))
            record(layer_idx, selection, visible)

        cache.stats.record = spy

    def per_layer(self) -> dict[int, list]:
        out: dict[int, list] = {}
        for layer, mask, visible, counts in self.calls:
            out.setdefault(layer, []).append((mask, visible, counts))
        return out


@torch.inference_mode()
def run_chunks(model, config, input_ids, prefix: int, chunk: int, attention_mask=None):
    """Dense prefill of `prefix` tokens, then the rest in chunks of `chunk`; returns (logits of the non-prefix
    positions, recorder)."""
    cache = SparseCache.for_model(model, config)
    recorder = Recorder(cache)
    logits = []
    # a prompt-rewriting method (gemfilter) decodes densely: fed as if its filter had run, it joins the matrices
    filtered = get_method_class(config.method).rewrites_prompt
    with sparsekv.enabled(model, config, prompt_filtered=filtered):
        bounds = [0, prefix, *range(prefix + chunk, input_ids.shape[1], chunk), input_ids.shape[1]]
        bounds = sorted(set(bounds))
        for lo, hi in itertools.pairwise(bounds):
            mask = None if attention_mask is None else attention_mask[:, :hi]
            position_ids = None
            if attention_mask is not None:
                position_ids = (attention_mask[:, :hi].cumsum(-1) - 1).clamp(min=0)[:, lo:hi]
            out = model(input_ids=input_ids[:, lo:hi], attention_mask=mask, position_ids=position_ids,
                        **cache_kwargs(model, cache), use_cache=True)
            if lo >= prefix:
                logits.append(out.logits)
    return torch.cat(logits, dim=1), recorder


def free_port() -> int:
    """A TCP port nobody listens on now: the rendezvous of a multi-process test."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
