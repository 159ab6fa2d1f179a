"""One exception type per domain. The CLI prints them as one line, without a traceback."""


class ToolkitError(Exception):
    """Base class: an error the user can act on (bad input, unsupported model, ...)."""


class ConversionError(ToolkitError):
    """A checkpoint cannot be converted exactly, or its files are inconsistent."""


class VerificationError(ToolkitError):
    """A converted checkpoint does not reproduce its source model."""


class DistributedError(ToolkitError):
    """A worker process of a multi-process run failed."""


class ReportedByAnotherRank(ToolkitError):
    """A failure every rank shares (a full disk under run_dir) that another rank has already said in
    one line: this rank exits non-zero without a word, so the user reads the line once."""


class ConfigError(ToolkitError):
    """A DeepSpeed config, a training recipe or a parallel layout cannot work as asked
    (bad arithmetic, incompatible options, unknown keys)."""


class AdapterError(ToolkitError):
    """A LoRA adapter cannot be built, loaded or exported as asked."""


class SlurmError(ToolkitError):
    """A Slurm job cannot be rendered, submitted or inspected as asked."""


class ParityError(ToolkitError):
    """`toolkit parity` cannot run as asked: input it does not read, a model that does not fit, a run that failed."""
