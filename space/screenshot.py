"""A screenshot of the Space after an example run, for the docs (`docs/space.png`).

    python space/screenshot.py --models space/models.json --example 10 --output docs/space.png

Serves the page opened on a finished run of `EXAMPLES[--example]` (the first target and drafter of `--models`),
captures it with headless Chromium (`apt-get install chromium`) and stores it as a 256-colour PNG, which keeps the
flat colours of a web page exact at a fraction of the size.
"""

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

from allowlist import ModelCatalog
from app import EXAMPLES, build_demo
from live_decoding import OspreySpace
from PIL import Image


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=Path, default=Path(__file__).resolve().parent / "models.json")
    parser.add_argument("--example", type=int, default=len(EXAMPLES) - 1, help="index into app.EXAMPLES")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument(
        "--results", type=Path, help="`osprey bench` results folder for the τ plot (default: the app's)"
    )
    parser.add_argument("--size", default="1280,1560", help="browser window WIDTH,HEIGHT in pixels")
    parser.add_argument("--output", type=Path, default=Path("docs/space.png"))
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --output file")
    args = parser.parse_args()
    if args.output.exists() and not args.overwrite:
        raise SystemExit(f"{args.output} exists; pass --overwrite to replace it, or choose another --output.")
    browser = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if browser is None:
        raise SystemExit("No Chromium found: install it (`apt-get install -y chromium`) and run this again.")

    space = OspreySpace(ModelCatalog.from_json(args.models), results_dir=args.results)
    prefill = {"prompt": EXAMPLES[args.example][1], "max_new_tokens": args.max_new_tokens}
    demo = build_demo(space, prefill)
    demo.launch(server_name="127.0.0.1", prevent_thread_lock=True, quiet=True)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            capture = Path(scratch) / "page.png"
            subprocess.run(
                [
                    browser,
                    "--headless",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-background-networking",
                    "--hide-scrollbars",
                    f"--user-data-dir={scratch}/profile",
                    f"--window-size={args.size}",
                    "--virtual-time-budget=20000",
                    f"--screenshot={capture}",
                    demo.local_url,
                ],
                check=True,
                capture_output=True,
                timeout=180,
            )
            args.output.parent.mkdir(parents=True, exist_ok=True)
            Image.open(capture).convert("RGB").quantize(colors=256).save(args.output, optimize=True)
    finally:
        demo.close()
    print(f"{args.output}: {args.output.stat().st_size // 1024} KB")


if __name__ == "__main__":
    main()
