"""`toolkit parity`: a user's recipe on megatron-core against the HF model with torch AdamW, step by step.

    from toolkit.parity import ParityRequest, run_parity
    verdict = run_parity(ParityRequest("recipe.yaml", steps=5))
    verdict.ok, verdict.first_divergence, verdict.summary()
"""

from toolkit.parity.check import DEFAULT_STEPS, ParityRequest, plan, run_parity
from toolkit.parity.verdict import Verdict, judge

__all__ = ["DEFAULT_STEPS", "ParityRequest", "Verdict", "judge", "plan", "run_parity"]
