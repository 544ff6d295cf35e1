"""Osprey speculative decoding, live: a Gradio Space.

One prompt runs twice: first with an Osprey drafter proposing chains that the target verifies (each step's accepted
drafts highlighted), then with the target alone for as many tokens; τ, tokens/s and the speedup update as it runs.
Models come only from a server-side allow-list (`models.json`, see README.md). Run locally: `python space/app.py`.
"""

import argparse
import os
from functools import partial
from pathlib import Path

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")  # a demo of local models reports to nobody

import gradio as gr
from allowlist import PAGE_SETTINGS, ModelCatalog
from live_decoding import ACCEPTED, APP_DIR, ROUTES, TARGET, OspreySpace

EXAMPLES = [  # (label, prompt): the categories and languages where drafters differ most
    # The page opens on the first: `osprey demo`'s chat prompt, where the shipped drafter with its settings is well
    # ahead of the target alone on a CPU (space/README.md).
    ("chat · en", "Give me three tips for staying focused while working from home."),
    ("code · en", "Write a Python function that returns True when a string is a palindrome, ignoring case."),
    ("code · en", "Write an SQL query listing each customer's three most recent orders."),
    ("math · en", "A train covers 180 km in 2.5 hours. What is its average speed? Show the steps."),
    ("math · zh", "小明有12个苹果，送给朋友5个，又买了8个。他现在有几个苹果？"),
    ("translation · en→de", "Translate into German: The weather is lovely today, so we are walking to the lake."),
    ("translation · fr→en", "Traduis en anglais : Je voudrais réserver une table pour deux personnes ce soir."),
    ("chat · de", "Was ist der Unterschied zwischen einem Fluss und einem Bach?"),
    ("chat · fr", "Donne-moi trois conseils pour mieux dormir."),
    ("chat · ja", "日本の四季について短く説明してください。"),
    ("chat · zh", "请用三句话介绍一下长城。"),
    ("chat · en", "Explain speculative decoding to a ten-year-old."),
]

INTRO = """# Osprey: speculative decoding, live
A small **drafter** proposes tokens (a chain, or a tree of alternatives, optionally with one more branch copied from
what followed the same words earlier in the text), the **target** checks them all in one forward pass and keeps the
longest path it agrees with, plus one token of its own. The output is the target's (greedy: token for token, except
where half precision rounds a near tie differently, which the page measures and says; sampling: the same
distribution), only faster when the drafter is good. **τ** is the mean number of tokens per verification step;
speedup compares with the target decoding alone, measured right after on the same machine."""

STAT_LABELS = {
    "tau": "τ (tokens per verify step)",
    "osprey_tokens_per_s": "Osprey tokens/s",
    "target_tokens_per_s": "Target-only tokens/s",
    "speedup": "Speedup over the target alone",
    "new_tokens": "New tokens",
    "verify_steps": "Verify steps",
}


def build_demo(space: OspreySpace) -> gr.Blocks:
    """The page, opened on the first example with the first target and drafter, and that drafter's settings
    (measured ones for a drafter `osprey demo` ships: `ModelCatalog.settings`); press Generate to run it."""
    catalog, limits = space.catalog, space.limits
    first_target = catalog.target_names()[0]
    first_drafter = catalog.drafter_names(first_target)[0]
    request = {
        "prompt": EXAMPLES[0][1],
        "target_name": first_target,
        "drafter_name": first_drafter,
        **catalog.settings(first_target, first_drafter),
        "temperature": 0.0,
        "route": "standalone",
        "max_new_tokens": min(128, limits.max_new_tokens),
    }
    # Every allow-listed drafter is a valid choice server-side; picking a target narrows the list in the page.
    all_drafters = list(
        dict.fromkeys(name for target in catalog.target_names() for name in catalog.drafter_names(target))
    )

    with gr.Blocks(title="Osprey speculative decoding") as demo:
        gr.Markdown(INTRO)
        with gr.Row():
            with gr.Column(scale=3):
                prompt = gr.Textbox(
                    value=request["prompt"],
                    label="Prompt",
                    lines=4,
                    max_length=limits.max_prompt_chars,
                    placeholder="Ask anything, or pick an example below.",
                    elem_id="prompt",
                )
                run = gr.Button("Generate", variant="primary", elem_id="generate")
                gr.Examples(
                    [[text] for _, text in EXAMPLES],
                    inputs=[prompt],
                    example_labels=[label for label, _ in EXAMPLES],
                    examples_per_page=len(EXAMPLES),
                    elem_id="examples",
                )
                # The results beside the controls, so a run's speedup shows without scrolling.
                with gr.Row():
                    stats = [
                        gr.Textbox(label=label, interactive=False, max_lines=1, min_width=100, elem_id=f"stat-{name}")
                        for name, label in STAT_LABELS.items()
                    ]
                osprey_output = gr.HighlightedText(
                    label="Osprey: target + drafter",
                    show_legend=True,
                    show_inline_category=False,
                    color_map={ACCEPTED: "#34d399", TARGET: "#fbbf24"},
                    elem_id="osprey-output",
                )
                target_output = gr.Textbox(label="Target only", lines=6, interactive=False, elem_id="target-output")
            with gr.Column(scale=2):
                target = gr.Dropdown(catalog.target_names(), value=request["target_name"], label="Target")
                drafter = gr.Dropdown(all_drafters, value=request["drafter_name"], label="Osprey drafter")
                num_draft_tokens = gr.Slider(
                    1,
                    limits.max_draft_tokens,
                    value=request["num_draft_tokens"],
                    step=1,
                    label="Draft length",
                    elem_id="num_draft_tokens",
                )
                draft_topk = gr.Slider(
                    1,
                    limits.max_draft_topk,
                    value=request["draft_topk"],
                    step=1,
                    label="Branching: draft a tree of the K most probable continuations per level (1 = chains)",
                    elem_id="draft_topk",
                )
                tree_size = gr.Slider(
                    1,
                    limits.max_tree_size,
                    value=request["tree_size"],
                    step=1,
                    label="Tree size: draft nodes the target verifies per step (trees, or chains with a lookup branch)",
                    elem_id="tree_size",
                )
                prompt_lookup = gr.Slider(
                    0,
                    limits.max_prompt_lookup_tokens,
                    value=request["prompt_lookup_num_tokens"],
                    step=1,
                    label="Prompt-lookup branch: one more branch of every draft, up to this many tokens that followed "
                    "the last two earlier in the text (0 = none)",
                    elem_id="prompt_lookup_num_tokens",
                )
                route = gr.Radio(
                    [(label, name) for name, label in ROUTES.items()],
                    value=request["route"],
                    label="Route: the same loop, from the osprey package or from the drafter's own custom_generate",
                )
                confidence_threshold = gr.Slider(
                    0,
                    1,
                    value=request["confidence_threshold"],
                    step=0.05,
                    label="Early stop: end a chain after a draft below this probability (0 = full chains)",
                    elem_id="confidence_threshold",
                )
                temperature = gr.Slider(
                    0, limits.max_temperature, value=request["temperature"], step=0.05, label="Temperature (0 = greedy)"
                )
                max_new_tokens = gr.Slider(
                    1, limits.max_new_tokens, value=request["max_new_tokens"], step=1, label="Max new tokens"
                )
        tree_view = gr.HTML(label="Last verified draft tree (accepted path in green)", elem_id="tree")
        gr.Markdown("## τ per category and language, from saved benchmarks")
        benchmark_plot = gr.ScatterPlot(
            x="category",
            y="tau",
            color="series",
            color_title="results file: method",
            x_title="suite / category",
            y_title="τ",
            x_label_angle=-30,
            visible=False,
        )
        benchmark_note = gr.Markdown()

        target.change(space.drafter_choices, target, drafter, api_name=False)
        # The drafting controls by setting name (each control's elem_id).
        drafting = {
            control.elem_id: control
            for control in (num_draft_tokens, draft_topk, tree_size, prompt_lookup, confidence_threshold)
        }
        # Picking a drafter sets the shape it decodes best with (its measured settings, else the page's defaults).
        drafter.change(
            space.drafter_settings, [target, drafter], [drafting[name] for name in PAGE_SETTINGS], api_name=False
        )
        inputs = [
            prompt,
            target,
            drafter,
            num_draft_tokens,
            temperature,
            max_new_tokens,
            confidence_threshold,
            draft_topk,
            tree_size,
            route,
            prompt_lookup,
        ]
        # One generation at a time: timings are only honest without other requests competing for the hardware.
        gr.on(
            [run.click, prompt.submit],
            space.generate,
            inputs,
            [osprey_output, target_output, *stats, tree_view],
            api_name="generate",
            concurrency_limit=1,
        )
        demo.load(partial(benchmark_outputs, space), None, [benchmark_plot, benchmark_note], api_name=False)
    return demo.queue(max_size=limits.max_queue)


def benchmark_outputs(space: OspreySpace):
    """Read on every page load, so new results show without a restart; the plot is hidden while there are none."""
    frame, note = space.benchmark_view()
    top = float(frame["tau"].max()) + 0.5 if not frame.empty else None  # τ axis from 0, with room above the best
    return gr.ScatterPlot(value=frame, visible=not frame.empty, y_lim=[0, top]), note


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models",
        default=os.environ.get("OSPREY_SPACE_MODELS", APP_DIR / "models.json"),
        type=Path,
        help="allow-list of targets and drafters (default: $OSPREY_SPACE_MODELS or space/models.json)",
    )
    parser.add_argument("--results", default=os.environ.get("OSPREY_SPACE_RESULTS"), help="benchmark results folder")
    parser.add_argument("--host", help="address to serve on (default: Gradio's, 127.0.0.1 locally)")
    parser.add_argument("--port", type=int)
    args = parser.parse_args()
    space = OspreySpace(ModelCatalog.from_json(args.models), results_dir=args.results)
    build_demo(space).launch(server_name=args.host, server_port=args.port)


if __name__ == "__main__":
    main()
