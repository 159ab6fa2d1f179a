"""Start converting before transformers' config class has read config.json; confirm it afterwards.

Importing a transformers config class costs about 1.5 s of one core (its modules import
torch.distributed.tensor, sympy and jinja2: docs/benchmarks.md), a tenth of an 8B conversion,
while the disk waits. So where nothing has imported transformers yet (the CLI's own process) and
`os.fork` exists, the class reads config.json in a forked child, while this process reads the
ModelSpec from the file's own values (`SpecGuess.guess`) and starts writing under the output's
.partial name. The child's ModelSpec is compared with the guess as records are placed
(`check()`, from the progress callback) and, at the latest, before the metadata is written
(`check(wait=True)`):

* the class refuses config.json: ConversionError with its words (the partial output is removed,
  as for any error);
* the class reads another ModelSpec (a default or derived value the file leaves out, such as
  DeepseekV3Config's head_dim, its qk_rope_head_dim): GuessWrong, and the conversion starts again
  on the class's values (`confirmed()`, the child's ModelSpec through JSON, as checkpoint metadata
  carries it).

What is written is therefore always what the class's values give: the guess only decides when the
first byte is written. Elsewhere (transformers already imported, as in tests or a notebook, where
the class costs nothing more; another thread running, where forking is unsafe; no fork) the class
reads the file first, as before.
"""

from __future__ import annotations

import gc
import json
import os
import select
import sys
import threading
from pathlib import Path

from toolkit.convert.hf_config import checked_family, checked_reading
from toolkit.errors import ConversionError
from toolkit.families import Family, ModelSpec
from toolkit.families.hf_values import ConfigValues
from toolkit.families.spec import read_spec


class GuessWrong(Exception):
    """transformers' config class read config.json into another ModelSpec than the guess."""


def _spec_json(spec: ModelSpec) -> str:
    return json.dumps(spec.to_dict(), sort_keys=True)


def _as_transformers_5(cfg: dict) -> dict:
    """The file's values as transformers 5's classes present an older file's rope settings (top-level
    rope_theta and rope_scaling become rope_parameters). Only a guess: the class's reading decides."""
    if "rope_parameters" in cfg or "rope_theta" not in cfg:
        return cfg
    params = dict(cfg.get("rope_scaling") or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    return {**cfg, "rope_parameters": {**params, "rope_theta": cfg["rope_theta"]}}


def guess_spec(cfg: dict, family: Family) -> ModelSpec | None:
    """The ModelSpec of config.json's own values, without transformers; None where the file leaves
    out a value the readers need (the class's default is then not guessed)."""
    values = _as_transformers_5(cfg)
    try:
        return read_spec(ConfigValues(values, cfg, "config.json"), family)
    except Exception:  # any refusal or missing key: the class's reading will say what is wrong
        return None


def _can_fork() -> bool:
    return hasattr(os, "fork") and "transformers" not in sys.modules and threading.active_count() == 1


class SpecGuess:
    """config.json read by transformers' config class in a forked child, and guessed meanwhile.

    `guess`: (family, spec) to start writing with, or None (then `confirmed()` reads first). Use as
    a context manager: leaving it reaps the child."""

    def __init__(self, cfg: dict, source: Path, tensor_names=None, fork: bool | None = None):
        self.cfg, self.source = cfg, source
        self.family = checked_family(cfg, source, tensor_names)
        self.guess: tuple[Family, ModelSpec] | None = None
        self._guess_json = None  # compared with the child's answer as each record is placed
        self._pid, self._pipe, self._answer = None, None, None
        self._lock = threading.Lock()
        if not (_can_fork() if fork is None else fork):
            return
        spec = guess_spec(cfg, self.family)
        if spec is not None:
            self.guess, self._guess_json = (self.family, spec), _spec_json(spec)
            self._start_child()

    def _start_child(self) -> None:
        read_end, write_end = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()  # nothing buffered is written twice
        pid = os.fork()
        if pid == 0:
            _answer_in_child(self.cfg, self.source, read_end, write_end)  # never returns
        os.close(write_end)
        self._pid, self._pipe = pid, read_end

    def _read_answer(self, wait: bool) -> dict | None:
        with self._lock:
            if self._answer is None and (wait or select.select([self._pipe], [], [], 0)[0]):
                chunks = []
                while chunk := os.read(self._pipe, 1 << 16):
                    chunks.append(chunk)
                self._reap()
                self._answer = json.loads(b"".join(chunks) or b'{"failed": "no answer"}')
            return self._answer

    def check(self, wait: bool = False) -> None:
        """Raise when the class has refused config.json (ConversionError) or read another spec than
        the guess (GuessWrong); without `wait`, only once its answer is there. Thread-safe."""
        if self.guess is None:
            return
        answer = self._read_answer(wait)
        if answer is None:
            return
        if "refused" in answer:
            raise ConversionError(answer["refused"])
        if answer.get("spec") != self._guess_json:
            raise GuessWrong(f"{self.source}: transformers' config class read another ModelSpec than the guess")

    def confirmed(self) -> tuple[Family, ModelSpec]:
        """(family, spec) as transformers' config class reads config.json (raising its refusal): the
        child's answer where there is one, else read here."""
        answer = self._read_answer(wait=True) if self.guess is not None else {}
        if "refused" in answer:
            raise ConversionError(answer["refused"])
        if "spec" in answer:
            same = answer["spec"] == self._guess_json
            return self.guess if same else (self.family, ModelSpec.from_dict(json.loads(answer["spec"])))
        family, spec, _ = checked_reading(self.cfg, self.source)  # no child, or it failed: read here
        return family, spec

    def _reap(self) -> None:
        if self._pid is not None:
            os.waitpid(self._pid, 0)
            os.close(self._pipe)
            self._pid = None

    def __enter__(self) -> "SpecGuess":
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            if self._pid is not None:
                try:
                    os.kill(self._pid, 9)
                except ProcessLookupError:
                    pass
                self._reap()


def _answer_in_child(cfg: dict, source: Path, read_end: int, pipe: int) -> None:
    """The forked child: transformers' reading of config.json, as JSON on `pipe`, then exit without
    running anything of the parent's (atexit handlers, buffered output). It skips the garbage
    collector's passes over the modules it imports (a sixth of their import time; it exits right
    after). Not reniced: at nice 10 an 8B conversion's refusal came after 9.6 s instead of 4.3 s."""
    try:
        gc.disable()
        os.close(read_end)
        try:
            _, spec, _ = checked_reading(cfg, source)
            answer = {"spec": _spec_json(spec)}
        except ConversionError as e:
            answer = {"refused": str(e)}
        data = json.dumps(answer).encode()
    except BaseException as e:  # anything else: the parent reads the file itself and meets it there
        data = json.dumps({"failed": repr(e)}).encode()
    finally:
        try:
            with os.fdopen(pipe, "wb") as f:
                f.write(data)
        finally:
            os._exit(0)
