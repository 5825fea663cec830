"""copt quantize: post-training quantization (AWQ, GPTQ, FP8, INT8, RTN) with a quality report."""

from clusteropt_cli.core.quantize.run import REPORT_NAME, Plan, QuantizeReport, plan, run

__all__ = ["REPORT_NAME", "Plan", "QuantizeReport", "plan", "run"]
