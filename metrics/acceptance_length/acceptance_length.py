"""Mean acceptance length τ of speculative decoding, from each request's log of accepted drafts per step."""

import datasets
import evaluate

_DESCRIPTION = """
Mean acceptance length τ: the tokens a speculative decoder produces per verification step of the target, i.e. the
draft tokens the target accepted plus the one token the target adds itself (a correction, or the bonus token when
every draft was accepted). By default τ is the mean over requests of each request's per-step mean, as Spec-Bench and
the EAGLE papers report it; the prefill (which verifies nothing) is not a step. Plain decoding has τ = 1.
"""

_KWARGS_DESCRIPTION = """
Args:
    accepted_per_step (`list[list[int]]`): one list per request: the number of draft tokens the target accepted at
        each of its verification steps.
    average (`str`, defaults to `"request"`): `"request"` averages each request's τ (requests without any step are
        left out, their τ being undefined); `"step"` pools every step of every request.
    bonus_token (`bool`, defaults to `True`): count the token the target adds at each step. With `False` the result
        is the mean number of accepted drafts per step (τ - 1).
Returns:
    acceptance_length (`float`): τ, or `None` when no request has a step.
    num_requests (`int`): requests that had at least one verification step.
    num_steps (`int`): verification steps in all.
Examples:
    >>> acceptance_length = evaluate.load("metrics/acceptance_length")
    >>> acceptance_length.compute(accepted_per_step=[[2, 0, 5], [1]])
    {'acceptance_length': 2.666666666666667, 'num_requests': 2, 'num_steps': 4}
    >>> acceptance_length.compute(accepted_per_step=[[2, 0, 5], [1]], average="step")
    {'acceptance_length': 3.0, 'num_requests': 2, 'num_steps': 4}
"""

_CITATION = """
@inproceedings{leviathan2023fast,
  title={Fast Inference from Transformers via Speculative Decoding},
  author={Leviathan, Yaniv and Kalman, Matan and Matias, Yossi},
  booktitle={International Conference on Machine Learning},
  year={2023}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class AcceptanceLength(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"accepted_per_step": datasets.List(datasets.Value("int64"))}),
        )

    def _compute(self, accepted_per_step, average="request", bonus_token=True):
        if average not in ("request", "step"):
            raise ValueError(f'average must be "request" or "step", got {average!r}.')
        if any(accepted < 0 for request in accepted_per_step for accepted in request):
            raise ValueError("accepted_per_step holds a negative count; each entry is a number of accepted drafts.")
        bonus = 1 if bonus_token else 0
        requests = [[accepted + bonus for accepted in request] for request in accepted_per_step if request]
        steps = [tokens for request in requests for tokens in request]
        if not steps:
            value = None
        elif average == "step":
            value = sum(steps) / len(steps)
        else:
            value = sum(sum(request) / len(request) for request in requests) / len(requests)
        return {"acceptance_length": value, "num_requests": len(requests), "num_steps": len(steps)}
