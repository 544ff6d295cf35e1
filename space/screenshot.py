"""A screenshot of the Space after pressing Generate in a real browser (`space/screenshot.png`, in space/README.md).

    python space/screenshot.py --models space/models.json --output space/screenshot.png

Serves the page with `--models`, opens it in headless Chromium (`browser.py`), keeps its default selection (the first
target and drafter, with that drafter's settings) and the prompt it opens with (or clicks `EXAMPLES[--example]`),
presses Generate, waits for the speedup and prints it with τ. The capture is stored as a 256-colour PNG, which keeps
the flat colours of a web page exact at a fraction of the size.
"""

import argparse
from pathlib import Path

from allowlist import ModelCatalog
from app import build_demo
from browser import BrowserMissing, find_browser, press_generate, served
from live_decoding import APP_DIR, OspreySpace
from PIL import Image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=APP_DIR / "models.json", help="allow-list (models.json)")
    parser.add_argument(
        "--example", type=int, help="click app.EXAMPLES[INDEX] first (default: the prompt the page opens with)"
    )
    parser.add_argument(
        "--results", type=Path, help="`osprey bench` results folder for the τ plot (default: the app's)"
    )
    parser.add_argument("--size", default="1280,1620", help="browser window WIDTH,HEIGHT in pixels")
    parser.add_argument("--output", type=Path, default=APP_DIR / "screenshot.png")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    args = parser.parse_args()
    if args.output.exists() and not args.overwrite:
        raise SystemExit(f"{args.output} exists; pass --overwrite to replace it, or choose another --output.")
    try:
        width, height = (int(pixels) for pixels in args.size.split(","))
    except ValueError:
        raise SystemExit(f"--size takes WIDTH,HEIGHT in pixels (as 1280,1620), got {args.size!r}.") from None
    try:
        find_browser()
    except BrowserMissing as error:
        raise SystemExit(str(error)) from None

    catalog = ModelCatalog.from_json(args.models)
    space = OspreySpace(catalog, results_dir=args.results)
    target_name = catalog.target_names()[0]
    drafter_name = catalog.drafter_names(target_name)[0]
    capture = args.output.with_name(f".{args.output.name}.capture.png")
    with served(build_demo(space)) as url:
        run = press_generate(url, capture, example=args.example, size=(width, height))
    Image.open(capture).convert("RGB").quantize(colors=256).save(args.output, optimize=True)
    capture.unlink()
    target, _, drafter = catalog.load(target_name, drafter_name)  # loaded by the run, cached
    int8 = any("quantized" in type(module).__module__ for module in drafter.modules())
    print(
        f"{target_name} in {str(target.dtype).removeprefix('torch.')} + {drafter_name}"
        f"{' (linear layers in int8)' if int8 else ''}, settings {catalog.settings(target_name, drafter_name)}"
    )
    print(f"prompt: {run.prompt}")
    print(f"speedup {run.stats['speedup']}, τ {run.stats['tau']} ({run.stats['new_tokens']} new tokens)")
    print(f"{args.output}: {args.output.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
