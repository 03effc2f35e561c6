"""What both recipes share, one concern per module:

- lifecycle.py: `run` opens the tracker, hands over to the recipe, and ends the MLflow run FINISHED, FAILED or
  KILLED; resume checks;
- setup.py: `setup` builds every component once (seed, tokenizer, policy, data, warm start, reference, engine,
  memory plan, rollout) into the frozen `Setup` record;
- frame.py: `Frame`, the step loop (eval and checkpoint cadence, deferred signals, metric reduction, logging);
- summary.py: the run's summary numbers and the dead-gradient watch;
- console.py: the end-of-run table, the results hint, sample tables, progress.
"""

from .console import PlainProgress, end_table, format_rows, header, progress, results_hint
from .frame import Frame, NonFiniteLossError, check_finite, meter_metrics, no_held_out, rank_slice
from .lifecycle import cfg_flat, load_resume, run
from .setup import Data, Setup, setup, timed
from .summary import DEAD_GRADIENT_STEPS, DEAD_GRADIENTS_TAG, Summary, watch_gradients

__all__ = ["DEAD_GRADIENTS_TAG", "DEAD_GRADIENT_STEPS", "Data", "Frame", "timed", "NonFiniteLossError",
           "PlainProgress", "Setup", "Summary", "cfg_flat", "check_finite", "end_table", "format_rows", "header",
           "load_resume", "meter_metrics", "no_held_out", "progress", "rank_slice", "results_hint", "run", "setup",
           "watch_gradients"]
