"""Per-position acceptance rates of speculative decoding: how often the k-th draft token of a chain is accepted."""

import datasets
import evaluate

_DESCRIPTION = """
Acceptance rate at each draft position: for position k (1 = the first draft token of a step), among all verification
steps that drafted at least k tokens, the fraction where the target accepted the k-th. Since a chain is accepted up
to its first rejection, the rates can only fall along the chain when every step drafts the same number of tokens;
they show where a drafter loses the target (a rate of 0.8 at position 1 and 0.3 at position 4 is typical of a good
drafter). Steps of all requests are pooled.
"""

_KWARGS_DESCRIPTION = """
Args:
    accepted_per_step (`list[list[int]]`): one list per request: draft tokens accepted at each verification step.
    drafted_per_step (`list[list[int]]`): one list per request, aligned with `accepted_per_step`: draft tokens
        proposed at each step.
Returns:
    position_acceptance (`list[float]`): the rate at draft positions 1, 2, ... up to the longest chain drafted.
    num_steps (`int`): verification steps in all.
Examples:
    >>> position_acceptance = evaluate.load("metrics/position_acceptance")
    >>> position_acceptance.compute(accepted_per_step=[[2, 0, 5], [1]], drafted_per_step=[[5, 5, 5], [3]])
    {'position_acceptance': [0.75, 0.5, 0.25, 0.3333333333333333, 0.3333333333333333], 'num_steps': 4}
"""

_CITATION = """
@article{li2025eagle3,
  title={{EAGLE-3}: Scaling up Inference Acceleration of Large Language Models via Training-Time Test},
  author={Li, Yuhui and Wei, Fangyun and Zhang, Chao and Zhang, Hongyang},
  journal={arXiv preprint arXiv:2503.01840},
  year={2025}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class PositionAcceptance(evaluate.Metric):
    def _info(self):
        steps = datasets.List(datasets.Value("int64"))
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"accepted_per_step": steps, "drafted_per_step": steps}),
        )

    def _compute(self, accepted_per_step, drafted_per_step):
        accepted_steps, drafted_steps = [], []
        for index, (accepted, drafted) in enumerate(zip(accepted_per_step, drafted_per_step)):
            if len(accepted) != len(drafted):
                raise ValueError(
                    f"Request {index} has {len(accepted)} accepted counts but {len(drafted)} drafted counts; "
                    "both lists need one entry per verification step."
                )
            if any(not 0 <= a <= d for a, d in zip(accepted, drafted)):
                raise ValueError(f"Request {index} accepts more drafts than it proposed, or a negative number.")
            accepted_steps += accepted
            drafted_steps += drafted
        rates = []
        for position in range(max(drafted_steps, default=0)):
            reached = sum(1 for drafted in drafted_steps if drafted > position)
            rates.append(sum(1 for accepted in accepted_steps if accepted > position) / reached)
        return {"position_acceptance": rates, "num_steps": len(drafted_steps)}
