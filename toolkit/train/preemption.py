"""Stop cleanly when the cluster asks: a signal sets a flag, all ranks agree on it every step
(the signal reaches ranks at different moments; the flag rides on the step's loss all-reduce,
toolkit.train.step.reduce_step_totals), then every rank saves and exits with
PREEMPTED_EXIT_CODE after the same step, so the batch script knows to requeue."""

from __future__ import annotations

import signal

# Distinct from failures (1), usage errors (2) and signal deaths (128+N).
PREEMPTED_EXIT_CODE = 99
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class PreemptionFlag:
    def __init__(self, signals=SIGNALS):
        self.requested = False
        self.signal_name: str | None = None
        for sig in signals:
            signal.signal(sig, self._handler)

    def _handler(self, signum, frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name
