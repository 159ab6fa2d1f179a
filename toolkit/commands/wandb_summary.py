"""`toolkit wandb-summary RUN_DIR`: what an offline W&B run logged, without a network."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("wandb-summary", help="read offline W&B runs back (merged across requeues)",
                       description="Read every offline W&B run below RUN_DIR with wandb's own record format, merge "
                                   "the directories of each run id (one per start of a requeued job) and print "
                                   "steps, metrics and last values.")
    p.add_argument("run_dir")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_run)


def _run(args) -> int:
    from toolkit.wandb_offline import read_runs, summarize

    summaries = [summarize(run) for run in read_runs(args.run_dir).values()]
    if args.json:
        print(json.dumps(summaries, indent=2, default=str))
        return 0
    for s in summaries:
        steps = s["steps"]
        once = "each once" if steps["each_once"] else "NOT each once"
        print(f"run {s['run_id']} (project {s['project']}): {len(s['segments'])} offline dir(s), "
              f"steps {steps['first']}..{steps['last']} ({steps['rows']} rows, {once})")
        for seg in s["segments"]:
            exit_code = "killed (no exit record)" if seg["exit_code"] is None else f"exit {seg['exit_code']}"
            span = f"steps {seg['steps'][0]}..{seg['steps'][-1]}" if seg["steps"] else "no steps"
            print(f"  {seg['dir']}: {span}, {exit_code}")
        print("  last: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in s["last"].items()))
        print(f"  config keys: {', '.join(s['config_keys'])}")
    return 0
