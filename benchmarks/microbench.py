"""What the microbenchmark scripts beside this file share: their JSON report."""

import json
import os
from pathlib import Path


def report(results: dict, output: Path | None) -> None:
    """Adds the load average (other jobs on the machine while it ran), prints `results` as JSON and writes them to
    `output` when given."""
    results["load_average"] = round(os.getloadavg()[0], 2)
    text = json.dumps(results, indent=2)
    print(text)
    if output:
        output.write_text(text + "\n")
