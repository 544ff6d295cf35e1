"""Wall-clock speedup of a decoding method over a baseline (usually the target decoding alone), from paired timings."""

import datasets
import evaluate

_DESCRIPTION = """
Speedup of a decoding method over a baseline, from paired measurements: for each request, the method's and the
baseline's decoding time and generated tokens on the same prompt, ideally measured in the same process on the same
hardware. The speedup is the ratio of throughputs (generated tokens per second over all requests); with greedy
decoding both generate the same tokens, and it is the ratio of total times. The mean of per-request speedups is
returned too: it weighs every request alike, where the throughput ratio weighs long requests more.
"""

_KWARGS_DESCRIPTION = """
Args:
    time_s (`list[float]`): the method's decoding time per request, in seconds.
    new_tokens (`list[int]`): tokens the method generated per request.
    baseline_time_s (`list[float]`): the baseline's decoding time on the same requests.
    baseline_new_tokens (`list[int]`): tokens the baseline generated per request.
Returns:
    speedup (`float`): the method's throughput over the baseline's.
    mean_request_speedup (`float`): the mean over requests of each request's throughput ratio.
Examples:
    >>> speedup = evaluate.load("metrics/speedup")
    >>> speedup.compute(
    ...     time_s=[1.0, 2.0], new_tokens=[10, 10], baseline_time_s=[3.0, 3.0], baseline_new_tokens=[10, 10]
    ... )
    {'speedup': 2.0, 'mean_request_speedup': 2.25}
"""

_CITATION = """
@inproceedings{xia2024unlocking,
  title={Unlocking Efficiency in Large Language Model Inference: A Comprehensive Survey of Speculative Decoding},
  author={Xia, Heming and Yang, Zhe and Dong, Qingxiu and Wang, Peiyi and Li, Yongqi and Ge, Tao and Liu, Tianyu
          and Li, Wenjie and Sui, Zhifang},
  booktitle={Findings of the Association for Computational Linguistics: ACL 2024},
  year={2024}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Speedup(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "time_s": datasets.Value("float64"),
                    "new_tokens": datasets.Value("int64"),
                    "baseline_time_s": datasets.Value("float64"),
                    "baseline_new_tokens": datasets.Value("int64"),
                }
            ),
        )

    def _compute(self, time_s, new_tokens, baseline_time_s, baseline_new_tokens):
        if min(time_s + baseline_time_s, default=1.0) <= 0:
            raise ValueError("Every time must be positive (seconds spent decoding the request).")
        if min(new_tokens + baseline_new_tokens, default=1) <= 0:
            raise ValueError("Every request must have generated at least one token.")
        throughput = sum(new_tokens) / sum(time_s)
        baseline_throughput = sum(baseline_new_tokens) / sum(baseline_time_s)
        ratios = [(n / t) / (bn / bt) for t, n, bt, bn in zip(time_s, new_tokens, baseline_time_s, baseline_new_tokens)]
        return {"speedup": throughput / baseline_throughput, "mean_request_speedup": sum(ratios) / len(ratios)}
