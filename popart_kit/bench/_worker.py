"""One instance of a multi-instance variant (started by ``pk.launch``): times its session and
prints its numbers on one line."""

from __future__ import annotations

import json
import sys

from ._measure import RESULT, inputs_of, model_of, prepare, rss_mib
from ._timing import interleaved
from ._variants import Variant


def main(argv: list[str]) -> None:
    import time

    job = json.loads(argv[0])
    v = Variant(**job["variant"])
    built = model_of(v)
    start = time.perf_counter()
    cfg = v.config(popdist=True).with_popdist_env()
    sess = prepare(v, "xla", built, cfg)
    sess.prepare()
    inputs = inputs_of(sess, built)
    sess.run(inputs)
    ready = time.perf_counter() - start
    t = interleaved(job["repeat"], job["warmup"], session=lambda: sess.run(inputs))["session"]
    samples = sess.plan.samples_per_step
    print(RESULT + json.dumps({
        "compile_s": max(0.0, ready - t.median), "runs": t.runs, "step_ms": t.median * 1e3,
        "step_ms_p25": t.p25 * 1e3, "step_ms_p75": t.p75 * 1e3, "step_ms_min": t.min * 1e3,
        "step_ms_max": t.max * 1e3, "spread": t.spread,
        "samples_per_step": samples * v.instances, "samples_per_s": samples / t.median,
        "rss_mib": rss_mib()}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
