"""`model.generate()`'s decode steps as CUDA graph replays.

An enabled model's `generate` runs its forward through `GraphDecode`. A one-token decode step of an unpadded batch
whose method has a fixed-shape step (`TokenSelector.fixed_shape`; the dense method and dense layers always do)
switches the cache to fixed shapes (`SparseCache.begin_fixed_shape`: the buffers preallocated for the whole
generation, the write position and the visible slots as device tensors). Every later step then has the same
shapes and reads nothing back from the device, so the whole forward — every layer's projections, selection and
attention — is captured once as a CUDA graph and replayed: a step costs one launch instead of a few thousand.

The first decode step runs eagerly (it completes the selectors' state from the prompt), the second runs once
eagerly and is captured, the rest replay. Forwards that do not fit — a padded batch, several new tokens, a method
without a fixed-shape step, a verification forward — run eagerly, and `path` says why. On CPU there are no CUDA
graphs; `graph_decode=True` then runs the same fixed-shape step eagerly (what the tests compare with the eager
path). The fixed-shape step attends over the whole preallocated buffer: slots not yet written are masked.
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator

import torch

from sparsekv.cache import SparseCache

#: transformers releases that take the cache as `cache` wrap every forward in one argument-renaming function, which
#: dynamo compiles once per wrapped forward around the graph breaks (model, decoder, layer, attention: up to 10)
COMPILE_RECOMPILE_LIMIT = 16


def compile_for_decode(fn, backend: str = "inductor"):
    """`fn` (a model's forward, or the model itself) through torch.compile, for decode steps. The cache update and
    the attention call stay outside the compiled graphs (both are `torch.compiler.disable`d: they hold Python state
    that changes every step); what compiles is the rest of each layer: norms, projections, rotary embedding, MLP,
    residuals. Layer indices stay unspecialised, so the layers share one graph instead of one graph each (which
    would pass dynamo's recompile limit of 8 and leave the later layers uncompiled)."""
    compiled = torch.compile(fn, backend=backend)

    def call(*args, **kwargs):
        with torch._dynamo.config.patch(allow_unspec_int_on_nn_module=True, recompile_limit=COMPILE_RECOMPILE_LIMIT):
            return compiled(*args, **kwargs)

    return call


@contextlib.contextmanager
def forward_replaced(model, forward) -> Iterator[None]:
    """Within the block, calling `model` (its hooks included) runs `forward` as its forward; then its own
    forward (the class's, or an instance attribute such as accelerate's wrapper) is back."""
    own = vars(model).get("forward")
    model.forward = forward
    try:
        yield
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own


#: model keywords a captured step may be given: the step's own tensors are replaced by static buffers; the rest
#: must be the same at every step (they are baked into the graph)
_STEP_TENSORS = ("input_ids", "position_ids", "cache_position", "attention_mask")


class GraphDecode:
    """Wraps one enabled model's forward for the duration of its `generate` calls (see the module docstring).

    mode: None (default) captures on CUDA only; True also runs the fixed-shape step on CPU (no graph there);
    False always decodes eagerly.
    compile_step: the fixed-shape step runs the forward compiled by `torch.compile` (see `enable`).
    """

    def __init__(self, forward, cache_name: str, mode: bool | None = None, compile_step: bool = False) -> None:
        self.forward = forward
        self.cache_name = cache_name
        self.mode = mode
        self.compile_step = compile_step
        self._compiled = None
        self.accepts_cache_position = "cache_position" in inspect.signature(forward).parameters
        #: how the latest forward ran: "graph", "fixed-shape" (CPU), either with " (dense fallback)" where the
        #: step attended densely (`SparseConfig.dense_below`), or "eager: <why>"
        self.path = "eager: no forward yet"
        #: decode steps per path of the latest generate() call
        self.steps: dict[str, int] = {}
        self.capacity = 0
        self._reset(None)

    def _reset(self, cache: SparseCache | None) -> None:
        self.cache = cache
        self.decoded = 0  # one-token forwards seen on this cache
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: dict[str, torch.Tensor] = {}
        self.fixed_kwargs: dict = {}
        self.output = None
        self.refusal: str | None = None

    def begin(self, capacity: int) -> None:
        """A generate() call starts; its cache will hold at most `capacity` tokens."""
        self.capacity = capacity
        self.steps = {}
        self._reset(None)

    def end(self) -> None:
        """The generate() call ended: its cache goes back to ordinary decoding (it may be fed again)."""
        if self.cache is not None:
            self.cache.end_fixed_shape()
        self._reset(None)

    # ---------------------------------------------------------------------------------------------------------
    def __call__(self, *args, **kwargs):
        cache = kwargs.get(self.cache_name)
        if cache is not self.cache:
            if self.cache is not None:
                self.cache.end_fixed_shape()
            self._reset(cache if isinstance(cache, SparseCache) else None)
            ids = kwargs.get("input_ids")
            if self.cache is not None and self.mode is not False and ids is not None:
                # the generations this runs take the dense fallback where the method's step would be slower
                prompt_tokens = self.cache.prompt_length or ids.shape[-1]
                self.cache.settle_fallback(ids.device.type, ids.shape[0], prompt_tokens)
        why = self._refusal(args, kwargs)
        if why is not None:
            if self.cache is not None and self.cache.fixed_position is not None:
                self.cache.end_fixed_shape()
                self.graph = None
            return self._count(f"eager: {why}", self.forward(*args, **kwargs))
        if self.cache.fixed_position is None:
            self.cache.begin_fixed_shape(self.capacity, compiled=self.compile_step)
            self.graph, self.output = None, None
        return self._fixed_step(kwargs)

    def _count(self, path: str, output):
        self.path = path
        self.steps[path] = self.steps.get(path, 0) + 1
        return output

    def _refusal(self, args, kwargs) -> str | None:
        """Why this forward runs eagerly (None: it takes the fixed-shape step)."""
        cache = self.cache
        if self.mode is False:
            return "graph_decode=False"
        if cache is None:
            return "no SparseCache"
        ids = kwargs.get("input_ids")
        if args or ids is None or kwargs.get("inputs_embeds") is not None:
            return "positional arguments or inputs_embeds"
        other = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and k not in _STEP_TENSORS]
        if other:  # a graph would keep reading the tensors of the step it captured
            return f"unsupported tensor input {', '.join(sorted(other))}"
        if kwargs.get("return_dict") is False:
            return "return_dict=False"
        if ids.dim() != 2 or ids.shape[1] != 1:
            self.decoded = 0  # a prompt (chunk) or several tokens: the next one-token step starts afresh
            return "prompt or several tokens"
        if self.mode is None and ids.device.type != "cuda":
            return "no CUDA device"
        if self.refusal is not None:
            return self.refusal
        self.decoded += 1
        if self.decoded == 1:
            # the first step completes the selectors' state from the prompt; it also tells whether the batch is padded
            mask = kwargs.get("attention_mask")
            if mask is not None and not bool(mask.all()):
                self.refusal = "the batch is padded"
                return self.refusal
            return "first decode step"
        if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            return "attentions or hidden states requested"
        capacity_why = cache.fixed_shape_refusal(self.capacity) if cache.fixed_position is None else None
        if capacity_why is not None:
            if cache.layers[0].length >= self.capacity:
                return capacity_why
            self.refusal = capacity_why  # the method or cache cannot: no use asking again this generation
            return capacity_why
        if cache.fixed_position is not None and cache.layers[0].length >= self.capacity:
            return f"past the capacity of {self.capacity} tokens"
        return None

    def _fixed_step(self, kwargs):
        cache = self.cache
        length = cache.layers[0].length
        fixed = {k: v for k, v in kwargs.items() if k not in _STEP_TENSORS}
        if self.output is not None and not _same(fixed, self.fixed_kwargs):
            self.graph, self.output = None, None  # other options than the captured step: capture again
        if self.output is None:
            ids = kwargs["input_ids"]
            self.inputs = {
                "input_ids": ids.clone(),
                "position_ids": torch.full_like(ids, length),
            }
            if self.accepts_cache_position:
                self.inputs["cache_position"] = torch.full((1,), length, dtype=torch.long, device=ids.device)
            self.fixed_kwargs = fixed
        else:
            self.inputs["input_ids"].copy_(kwargs["input_ids"])
        # the batch is unpadded: every row's position is the cached length
        for name in ("position_ids", "cache_position"):
            if name in self.inputs:
                self.inputs[name].fill_(length)
        cache.fixed_position.fill_(length)
        device = cache.fixed_position.device
        if device.type != "cuda":
            output = self._run()
            path = "fixed-shape"
        elif self.graph is not None:
            self.graph.replay()
            output = self.output
            path = "graph"
        else:
            output = self._capture()
            path = "graph" if self.graph is not None else f"eager: {self.refusal}"
        if cache.fixed_dense and not path.startswith("eager"):
            path += " (dense fallback)"
        cache.advance_fixed_shape()
        if self.graph is None and device.type == "cuda":
            cache.end_fixed_shape()  # the capture failed: the rest of the generation decodes eagerly
        return self._count(path, _detached(output))

    def _run(self):
        self.cache.prepare_fixed_step()
        return self.step_forward()(**self.fixed_kwargs, **self.inputs, attention_mask=None)

    def step_forward(self):
        """The forward of a fixed-shape step: the model's own, or (compile_step) its `compile_for_decode` version,
        built once. Shapes are the same at every step, so it compiles once."""
        if not self.compile_step:
            return self.forward
        if self._compiled is None:
            self._compiled = compile_for_decode(self.forward)
        return self._compiled

    def _capture(self):
        """Captures the step (`capture`). A capture that fails leaves the step's result and decodes the rest
        eagerly, with a warning."""
        output, self.output, self.graph, error = capture(self._run)
        if error is not None:
            self.refusal = error
            warnings.warn(f"sparsekv: {self.refusal}; decoding eagerly", RuntimeWarning, stacklevel=3)
        return output


def capture(run):
    """Runs `run()` once on a side stream (lazy allocations, kernel compilation and autotuning happen outside the
    capture), then captures a second call as a CUDA graph, which has not run: the side-stream run was the step.
    -> (that run's output with its logits copied out, the graph's output, the graph, None), or on a failed
    capture (output, None, None, why)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        output = run()
    torch.cuda.current_stream().wait_stream(stream)
    output = _detached(output)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            graph_output = run()
    except Exception as error:  # noqa: BLE001 -- reported by the caller, and the step's eager result stands
        return output, None, None, f"CUDA graph capture failed ({type(error).__name__}: {str(error).splitlines()[0]})"
    return output, graph_output, graph, None


def _same(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(x is y or (not isinstance(x, torch.Tensor) and x == y) for x, y in zip(a.values(), (b[k] for k in a)))


def _detached(output):
    """The step's output with its logits copied out of the graph's static buffer (the next replay overwrites it)."""
    logits = getattr(output, "logits", None)
    if logits is None:
        return output
    copy = type(output)(**{**output, "logits": logits.clone()})
    return copy
