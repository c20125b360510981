"""Ranks using the in-rank straggler API (nvrx.launcher.rank.straggler.Detector) under `nvrx launch`, gloo.

Argument: the output directory. Rank 1 takes twice as long in section ``fwd``; every rank writes the
report(s) it got to <out>/report<rank>.json.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from nvrx.launcher.rank.straggler import Detector, Statistic

dist.init_process_group("gloo")
rank = dist.get_rank()
Detector.initialize(scores_to_compute="all", gather_on_rank0=os.environ.get("GATHER", "1") == "1",
                    report_time_interval=0.5, node_name=f"node-{rank}")
grad = torch.ones(16)
reports = []
for step in range(40):
    with Detector.detection_section("fwd"):
        time.sleep(0.01 * (2 if rank == 1 else 1))
    with Detector.detection_section("data", profile_cuda=False):
        pass
    dist.all_reduce(grad)
    report = Detector.generate_report_if_interval_elapsed()
    if report is not None:
        reports.append({
            "rel": report.section_relative_perf_scores, "ind": report.section_individual_perf_scores,
            "nodes": report.rank_to_node, "num": report.local_section_summaries["fwd"][Statistic.NUM],
            "stragglers": sorted([s.rank, s.node] for s in report.identify_stragglers()
                                 ["straggler_sections_relative"].get("fwd", ()))})
Detector.shutdown()
with open(os.path.join(sys.argv[1], f"report{rank}.json"), "w") as fh:
    json.dump(reports, fh)
dist.destroy_process_group()
