"""Data analysis in a code-interpreter sandbox: a persistent Python context
loads a small dataset, computes per-region totals, plots them with
matplotlib, and the chart comes back as PNG bytes saved to a local file.

    CLADE_API_URL=http://127.0.0.1:8080 CLADE_API_KEY=clade_... python3 data_analysis.py [chart.png]
"""

from __future__ import annotations

import sys
from pathlib import Path

from clade import Clade

SALES_CSV = """\
month,region,revenue
2026-01,north,120
2026-01,south,95
2026-02,north,135
2026-02,south,110
2026-03,north,128
2026-03,south,142
"""


def main() -> int:
    chart_path = Path(sys.argv[1] if len(sys.argv) > 1 else "chart.png")
    with Clade() as client, client.sandboxes.create("code-interpreter") as sandbox:
        sandbox.files.write("/root/sales.csv", SALES_CSV)
        context = sandbox.create_code_context("python")
        context.run("import pandas as pd\nsales = pd.read_csv('/root/sales.csv')", timeout=120)
        totals = context.run("totals = sales.groupby('region')['revenue'].sum()\nprint(totals.to_json())", timeout=120)
        print("revenue by region:", totals.stdout.strip())
        chart = context.run(
            "import matplotlib\n"
            "import matplotlib.pyplot as plt\n"
            "fig, ax = plt.subplots(figsize=(6, 4))\n"
            "for region, rows in sales.groupby('region'):\n"
            "    ax.plot(rows['month'], rows['revenue'], marker='o', label=region)\n"
            "ax.set_title('Revenue by month'); ax.legend()\n"
            "plt.show()",
            timeout=120,
        )
        if chart.error:
            print(chart.error, file=sys.stderr)
            return 1
        png = next((result.png for result in chart.results if result.png), None)
        if png is None:
            print("the cell returned no PNG chart", file=sys.stderr)
            return 1
        chart_path.write_bytes(png)
        print(f"chart saved to {chart_path} ({len(png)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
