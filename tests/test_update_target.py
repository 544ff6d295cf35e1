"""The corpus of `benchmarks/update/make_target_update.py` (the V1 -> V2 target update): leads cut at sentence ends,
stubs and disambiguation pages left out, and a split by title hash that is deterministic and keeps the held-out
titles out of both the fine-tune and the adaptation prompts. Synthetic summaries stand in for the wheel."""

import importlib.util
import json
import random
from pathlib import Path

import pytest

SCRIPT = Path(__file__).parents[1] / "benchmarks" / "update" / "make_target_update.py"


@pytest.fixture(scope="module")
def update():
    spec = importlib.util.spec_from_file_location("make_target_update", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _summaries(per_language: int = 600) -> dict[str, dict]:
    lead = "{title} es un tema de prueba. Tiene una historia larga y bien documentada. " * 4
    return {
        lang: {f"Tema {lang} {i}": {"extract": lead.format(title=f"Tema {lang} {i}")} for i in range(per_language)}
        for lang in ("es", "fr")
    }


def test_cut_lead_ends_at_a_sentence(update):
    text = " ".join(["Una frase corta de unas cuantas palabras."] * 30)
    cut = update.cut_lead(text, limit=200)
    assert len(cut) <= 200 and cut.endswith(".")
    assert update.cut_lead("corta.\u00a0 Bien.") == "corta. Bien."
    long_sentence = "palabra " * 100
    cut = update.cut_lead(long_sentence, limit=60)
    assert cut.endswith("…") and len(cut) <= 61 and not cut[:-1].endswith(" ")


def test_stubs_disambiguations_and_markers_are_handled(update):
    prose = "Una descripción suficientemente larga del tema, con varias frases. " * 5
    summaries = {
        "es": {
            "Corto": {"extract": "Muy corto."},
            "Mercurio": {"extract": "Mercurio puede referirse a: " + prose},
            "Daga": {"extract": "La daga es un arma.[cita requerida] " + prose},
        },
        "fr": {"Mercure": {"extract": "Mercure peut désigner : " + prose}},
    }
    articles = update.build_articles(summaries)
    assert [a.title for a in articles] == ["Daga"]
    assert "[cita requerida]" not in articles[0].lead and articles[0].lead.startswith("La daga es un arma. Una")


def test_split_is_deterministic_and_keeps_held_out_titles_apart(update, tmp_path):
    summaries = _summaries()
    train, held_out = update.split_articles(update.build_articles(summaries))
    shuffled = {
        lang: dict(random.Random(1).sample(list(entries.items()), len(entries))) for lang, entries in summaries.items()
    }
    assert update.split_articles(update.build_articles(shuffled)) == (train, held_out)

    assert [a.language for a in held_out] == ["es", "fr"] * update.HELD_OUT_PER_LANGUAGE
    held_titles = {(a.language, a.title) for a in held_out}
    assert not held_titles & {(a.language, a.title) for a in train}
    assert all(a.key % update.TEST_BUCKETS == 0 for a in held_out)

    paths = update.write_prompt_files(train, held_out, tmp_path)
    held = [json.loads(line) for line in Path(paths["heldout_prompts"]).read_text().splitlines()]
    prompts = [json.loads(line) for line in Path(paths["train_prompts"]).read_text().splitlines()]
    assert {r["category"] for r in held} == {"es", "fr"} and len({r["id"] for r in held}) == len(held) == 40
    assert all(set(r) == {"id", "prompt", "category", "title"} for r in held + prompts)
    assert not {(r["category"], r["title"]) for r in prompts} & held_titles
    assert all(r["title"] in r["prompt"] for r in held + prompts)
