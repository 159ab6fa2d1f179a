"""Wall-clock split of training steps, for benchmarks/finetune_bench.py.

    torchrun ... benchmarks/step_phases.py OUT_JSON [recipe overrides ...]

runs recipes/finetune.py with timers around the phases of each step and hooks on every module
of the model, and writes rank 0's figures (mean per step over steps FIRST.., in ms) to OUT_JSON.
`PhaseTimer` does the same for the HF + DeepSpeed baseline. Nothing here changes what is computed.

No torch.profiler here: on CPU its per-op bookkeeping distorts op times (DeepSpeed's Adam sqrt over
the 1.8 M-element partition: 21 ms per call under the profiler, 1.7 ms without), so its table says
which ops run, and these clocks say where the step's time goes.

Phases, each exclusive of the phases nested in it:
  forward    the model's forward (megatron-core GPTModel / HF LlamaForCausalLM), logits included
  loss       cross entropy over the logits with the loss mask
  backward   autograd backward, DeepSpeed's per-parameter gradient hooks included
  skew       rank 0 waiting for the other ranks to finish their backward. Both sides meet at
             their step's first collective (ours: the (loss sum, stop flag) all-reduce; HF: DeepSpeed's
             reduction at the accumulation boundary); the timer puts a barrier just before it, on
             both sides, so that the wait is counted here and not in whichever collective comes first
  reduce     DeepSpeed's data-parallel gradient reduction (allreduce_gradients)
  optimizer  the rest of DeepSpeed's step: gradient norm, Adam, parameter all-gather
  totals     ours only: the step's one all-reduce of (loss sum, stop flag)
  loop       what is left of the step: the training loop's own work
and the forward's self time (time in a module minus time in its children) by module class, and
the backward of the decoder layers' attention and MLP blocks (`hook_backward`).
"""

from __future__ import annotations

import collections
import functools
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIRST = 4  # steps before this one are warm-up (first-step allocations, DeepSpeed's lazy set-up)
# The decoder layer's attention and MLP blocks on each side (their input is the norm's output).
BACKWARD_CLASSES = {"ours": ("SelfAttention", "MLP"), "hf": ("LlamaAttention", "LlamaMLP")}
PHASES = ("forward", "loss", "backward", "skew", "reduce", "optimizer", "totals", "loop")


def _sync() -> None:
    """On a GPU the clocks must wait for the kernels they time (which slows the timed run)."""
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _synced_now() -> float:
    _sync()
    return time.perf_counter()


def torch_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


class PhaseTimer:
    """Exclusive wall time per phase and per module class, on steps FIRST.. only."""

    def __init__(self):
        self.phase_ms: dict[str, float] = collections.defaultdict(float)
        self.module_ms: dict[str, float] = collections.defaultdict(float)
        self.backward_ms: dict[str, float] = collections.defaultdict(float)
        self.steps = 0
        self._stack: list[list] = []  # [name, start, time in nested timed regions]

    @property
    def _on(self) -> bool:
        return self.steps >= FIRST

    def _enter(self, name: str) -> None:
        _sync()
        self._stack.append([name, time.perf_counter(), 0.0])

    def _leave(self) -> tuple[str, float]:
        _sync()
        name, start, nested = self._stack.pop()
        spent = time.perf_counter() - start
        if self._stack:
            self._stack[-1][2] += spent
        return name, (spent - nested) * 1e3

    def wrap(self, phase: str, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            if not self._on:
                return fn(*args, **kwargs)
            self._enter(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                name, ms = self._leave()
                self.phase_ms[name] += ms

        return timed

    def aligned(self, fn, when=lambda *args: True):
        """fn, preceded by a barrier timed as the skew phase when `when(*args)`."""
        import torch.distributed as dist

        @functools.wraps(fn)
        def after_barrier(*args, **kwargs):
            if self._on and when(*args):
                self._enter("skew")
                dist.barrier()
                name, ms = self._leave()
                self.phase_ms[name] += ms
            return fn(*args, **kwargs)

        return after_barrier

    def wrap_step(self, fn):
        """The step function: what no phase claims is the loop's."""
        @functools.wraps(fn)
        def step(*args, **kwargs):
            self.steps += 1
            return self.wrap("loop", fn)(*args, **kwargs)

        return step

    def hook_modules(self, model) -> None:
        """Forward self time by module class. Module time nests inside the forward phase, so it
        is kept apart: the phase stack only sees the model's forward as a whole."""
        stack: list[list] = []

        def pre(module, args):
            if self._on:
                _sync()
                stack.append([time.perf_counter(), 0.0])

        def post(module, args, output):
            if self._on and stack:
                _sync()
                start, children = stack.pop()
                spent = time.perf_counter() - start
                if stack:
                    stack[-1][1] += spent
                self.module_ms[type(module).__name__] += (spent - children) * 1e3

        for module in model.modules():
            module.register_forward_pre_hook(pre)
            module.register_forward_hook(post)

    def hook_backward(self, model, classes: tuple[str, ...]) -> None:
        """Backward time of the modules of these classes, each from the moment its output's
        gradient is ready to the moment its input's is (tensor hooks; CPU autograd runs one node
        at a time). Only for modules whose input feeds nothing else (a decoder layer's attention
        and MLP take the norm's output), so that the input's gradient is theirs alone."""
        started: dict[int, float] = {}

        def pre(module, args, kwargs):
            inp = next((t for t in (*args, kwargs.get("hidden_states")) if torch_tensor(t) and t.requires_grad), None)
            if self._on and inp is not None:
                name = type(module).__name__
                inp.register_hook(lambda grad: self._backward_done(name, started.pop(id(module), None)))

        def post(module, args, kwargs, output):
            out = output[0] if isinstance(output, tuple) else output
            if self._on and torch_tensor(out) and out.requires_grad:
                out.register_hook(lambda grad: started.__setitem__(id(module), _synced_now()))

        for module in model.modules():
            if type(module).__name__ in classes:
                module.register_forward_pre_hook(pre, with_kwargs=True)
                module.register_forward_hook(post, with_kwargs=True)

    def _backward_done(self, name: str, start: float | None) -> None:
        if start is not None:
            self.backward_ms[name] += (_synced_now() - start) * 1e3

    def summary(self) -> dict:
        n = max(self.steps - FIRST + 1, 1)
        per_step = lambda totals: {k: v / n for k, v in sorted(totals.items(), key=lambda kv: -kv[1])}  # noqa: E731
        return {"steps": n, "phases": per_step(self.phase_ms), "modules": per_step(self.module_ms),
                "backward_modules": per_step(self.backward_ms)}


def time_deepspeed(timer: PhaseTimer) -> None:
    """DeepSpeed's gradient reduction and step, on both sides (HF's reduction runs inside
    engine.backward at the accumulation boundary, ours inside engine.step)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    at_boundary = DeepSpeedEngine.is_gradient_accumulation_boundary
    DeepSpeedEngine.allreduce_gradients = timer.wrap("reduce", timer.aligned(DeepSpeedEngine.allreduce_gradients, at_boundary))
    DeepSpeedEngine.step = timer.wrap("optimizer", DeepSpeedEngine.step)


def phase_table(ours: dict, base: dict, top: int = 10) -> str:
    """Both sides' phases side by side, then each side's forward self time by module class."""
    lines = [f"  {'phase (ms per step, rank 0)':<30} {'ours':>8} {'HF+DS':>8} {'diff':>8}"]
    for phase in PHASES:
        o, b = ours["phases"].get(phase, 0.0), base["phases"].get(phase, 0.0)
        lines.append(f"  {phase:<30} {o:8.1f} {b:8.1f} {o - b:+8.1f}")
    o, b = sum(ours["phases"].values()), sum(base["phases"].values())
    lines.append(f"  {'step':<30} {o:8.1f} {b:8.1f} {o - b:+8.1f}")
    for title, side in (("ours", ours), ("HF + DeepSpeed", base)):
        lines.append(f"  forward self time by module class, {title} (ms per step):")
        lines += [f"    {name:<44} {ms:7.1f}" for name, ms in list(side["modules"].items())[:top]]
        lines.append(f"  backward of the decoder layers' attention and MLP blocks, {title} (ms per step, inclusive):")
        lines += [f"    {name:<44} {ms:7.1f}" for name, ms in side["backward_modules"].items()]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    sys.path.insert(0, str(REPO / "recipes"))
    import finetune
    import megatron.core.pipeline_parallel.schedules as schedules
    from megatron.core.models.gpt.gpt_model import GPTModel

    from toolkit.train import loss as loss_lib
    from toolkit.train import step as step_module

    out, overrides = Path(argv[0]), argv[1:]
    timer = PhaseTimer()
    time_deepspeed(timer)
    GPTModel.forward = timer.wrap("forward", GPTModel.forward)
    # The schedule and our step look these up by module attribute at each call.
    schedules.backward_step = timer.wrap("backward", schedules.backward_step)
    loss_lib.token_losses = timer.wrap("loss", loss_lib.token_losses)
    loss_lib.scaled_loss = timer.wrap("loss", loss_lib.scaled_loss)
    step_module.reduce_step_totals = timer.wrap("totals", timer.aligned(step_module.reduce_step_totals))
    hooked = []

    def train_step(engine, module, *args, **kwargs):
        if not hooked:
            timer.hook_modules(module)
            timer.hook_backward(module, BACKWARD_CLASSES["ours"])
            hooked.append(True)
        return step_module_train_step(engine, module, *args, **kwargs)

    step_module_train_step = step_module.train_step
    step_module.train_step = timer.wrap_step(train_step)
    code = finetune.main(overrides)
    if int(os.environ.get("RANK", "0")) == 0:
        out.write_text(json.dumps(timer.summary()))
    return code


if __name__ == "__main__":  # a torchrun-launched script needs the guard (dist-checkpoint saves)
    raise SystemExit(main(sys.argv[1:]))
