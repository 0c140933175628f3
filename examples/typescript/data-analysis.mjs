// Data analysis in a sandbox: a code context (Python, the code-interpreter
// template) loads a small dataset with pandas, summarises it, plots it with
// matplotlib, and the chart comes back as PNG bytes saved to a local file.
//
//   CLADE_API_URL=http://127.0.0.1:8080 CLADE_API_KEY=clade_… node data-analysis.mjs [chart.png]

import { writeFile } from 'node:fs/promises';
import { Clade } from '@clade/sdk';

const output = process.argv[2] ?? 'chart.png';
const client = new Clade();

const CSV = `month,visitors,signups
Jan,1200,85
Feb,1350,97
Mar,1610,130
Apr,1580,121
May,1900,160
Jun,2240,198
`;

// (In TypeScript, `await using sandbox = …` deletes it at the end of the block.)
const sandbox = await client.sandboxes.create({ template: 'code-interpreter' });
try {
  await sandbox.files.write('/root/traffic.csv', CSV);

  // Cells run in one context: `df` lives on from cell to cell.
  const load = await sandbox.runCode(`
import pandas as pd
df = pd.read_csv("/root/traffic.csv")
df["rate"] = df.signups / df.visitors
print(df.describe().loc[["mean", "max"]].round(3).to_string())
`, { timeoutMs: 120_000 });
  if (load.error) throw new Error(load.error);
  console.log(load.stdout);

  const plot = await sandbox.runCode(`
import matplotlib.pyplot as plt
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.bar(df.month, df.visitors, color="#7aa6c2", label="visitors")
ax2 = ax.twinx()
ax2.plot(df.month, df.rate * 100, color="#c0392b", marker="o", label="signup rate %")
ax.set_title("Visitors and signup rate")
fig.tight_layout()
plt.show()
`, { timeoutMs: 120_000 });
  if (plot.error) throw new Error(plot.error);

  const chart = plot.results.find((result) => result.png);
  if (!chart?.png) throw new Error(`no chart came back (formats: ${plot.results.map((r) => r.formats.join('+')).join(', ')})`);
  await writeFile(output, chart.png);
  console.log(`saved the chart to ${output} (${chart.png.length} bytes)`);
} finally {
  await sandbox.delete();
}
