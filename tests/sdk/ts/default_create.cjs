// A create through the unmodified PandaStack TypeScript SDK that names no
// template (the SDK asks for `ubuntu-24.04`), one command, then delete.
// Prints one JSON line: the sandbox's template and the command's output.
// Env: CLADE_SDK_NODE_MODULES (where scripts/install-sdk-deps put the SDK),
// PANDASTACK_API_URL, PANDASTACK_API_KEY.
const { Client } = require(`${process.env.CLADE_SDK_NODE_MODULES}/@pandastack/sdk`);

async function main() {
  const client = new Client({ apiUrl: process.env.PANDASTACK_API_URL, apiKey: process.env.PANDASTACK_API_KEY });
  const sandbox = await client.sandboxes.create();
  try {
    const result = await sandbox.exec(". /etc/os-release; echo $ID");
    console.log(JSON.stringify({ template: sandbox.template, stdout: result.stdout, exitCode: result.exitCode }));
  } finally {
    await client.sandboxes.delete(sandbox.id);
  }
}

main().catch((error) => {
  console.error(error);
  process.exit(1);
});
