"""The stored tensors HF's model ignores on load: one list per checkpoint, computed once with its family
(toolkit.convert.wrapper.open_hf), which the converter, the consistency checks and the exporter all read.

Each kind is a rule of the family or of transformers itself, and HF's model drops what it matches:
  * stored rotary buffers (`*.rotary_emb.inv_freq`, older checkpoints of every family): transformers
    computes the frequencies from config.json and drops these on load (modeling_utils.py
    `_adjust_missing_and_unexpected_keys`);
  * multi-token-prediction layers, stored after the decoder layers (`model.layers.<num_hidden_layers + i>.*`,
    Family.mtp_key: GLM-4.5, DeepSeek-V3) or under a prefix of their own (Family.mtp_prefix: Qwen3-Next's
    `mtp.*`); the classes list them in `_keys_to_ignore_on_load_unexpected` (tests/test_ignored_on_load.py
    checks the family's rules cover the installed class's patterns).
The conversion leaves them out, saying so, and records how many in the metadata (CheckpointMeta.ignored),
so the export says what it does not write.
"""

from __future__ import annotations

from toolkit.families.table import Family

ROTARY_SUFFIX = "rotary_emb.inv_freq"
ROTARY, MTP = "rotary", "mtp"
KIND_NAMES = {ROTARY: "stored rotary frequency buffer(s)", MTP: "multi-token-prediction tensor(s)"}


def ignored_on_load(names, cfg: dict, family: Family | None) -> dict[str, list[str]]:
    """kind -> the tensors of `names` (HF names, a config.json `cfg` of `family`) HF's model ignores on
    load, sorted; kinds with none left out. Without a family (a model_type refused later) only the rules
    of transformers itself apply."""
    names = sorted(names)
    found = {ROTARY: [n for n in names if n.endswith(ROTARY_SUFFIX)]}
    prefixes = _mtp_prefixes(cfg, family)
    if prefixes:
        found[MTP] = [n for n in names if n.startswith(prefixes) and not n.endswith(ROTARY_SUFFIX)]
    return {kind: listed for kind, listed in found.items() if listed}


def _mtp_prefixes(cfg: dict, family: Family | None) -> tuple[str, ...]:
    if family is None:
        return ()
    count = cfg.get(family.mtp_key) if family.mtp_key else 0
    layers = cfg.get("num_hidden_layers")
    after = (tuple(f"model.layers.{layers + i}." for i in range(count))
             if type(count) is int and type(layers) is int else ())  # wrong types: the config class refuses them
    return after + ((family.mtp_prefix,) if family.mtp_prefix else ())


def note(kind: str, names: list[str], cfg: dict, family: Family) -> str:
    """The line saying what the conversion leaves out of this kind, and why."""
    if kind == ROTARY:
        return (f"{len(names)} stored rotary frequency buffer(s) (e.g. {names[0]!r}) are left out: transformers "
                "recomputes them from config.json and ignores them on load too")
    where = (f"{len(names)} tensors {family.mtp_prefix}*" if family.mtp_prefix else
             f"{family.mtp_key}={cfg[family.mtp_key]}, {len(names)} tensors from model.layers.{cfg['num_hidden_layers']}.")
    return (f"the multi-token-prediction layer(s) ({where}) are left out: HF's {family.architecture} ignores them on "
            "load too, and megatron-core's MTP block (mtp_num_layers) is not converted yet")


def drop(view, family: Family | None) -> None:
    """Compute the list of `view` (an opened HF checkpoint: config, tensors) once, as `view.ignored`, and take
    its tensors out of `view.tensors`: nothing downstream reads or counts them."""
    view.ignored = ignored_on_load(view.tensors, view.config, family)
    for names in view.ignored.values():
        for name in names:
            del view.tensors[name]
