// Runs a Clade function in its sandbox (written to /fn/.clade/run.js at
// deploy, kept in the function's snapshot): `node run.js ENTRYPOINT`.
//
// The invocation's input arrives as JSON on stdin. The module is loaded
// (`require`, or `import()` for an ES module); when it exports a handler
// (`module.exports = fn`, `exports.handler`, `export default`, `export
// function handler`) it is called with the event (and a context), awaited,
// and what it returns is written as JSON to $CLADE_OUTPUT, the run's
// output. A module without one has run as a script, with the input on
// `process.stdin`. A thrown error prints its stack and exits 1.
"use strict";
const fs = require("fs");
const path = require("path");
const { Readable } = require("stream");
const { pathToFileURL } = require("url");

const ROOT = "/fn";

function readInput() {
  try {
    return fs.readFileSync(0, "utf8");
  } catch {
    return "";
  }
}

function handlerOf(mod) {
  if (typeof mod === "function") return mod;
  if (mod && typeof mod.handler === "function") return mod.handler;
  if (mod && typeof mod.default === "function") return mod.default;
  if (mod && mod.default && typeof mod.default.handler === "function") return mod.default.handler;
  return null;
}

async function main() {
  const entry = path.join(ROOT, process.argv[2]);
  const raw = readInput();
  let event = null;
  if (raw.trim()) {
    try {
      event = JSON.parse(raw);
    } catch {
      event = raw;
    }
  }
  // A script that reads its stdin finds the input there.
  Object.defineProperty(process, "stdin", { value: Readable.from([raw]), configurable: true });
  process.argv = [process.argv[0], entry];
  module.paths.unshift(path.join(ROOT, "node_modules"));
  let mod;
  if (entry.endsWith(".mjs")) {
    mod = await import(pathToFileURL(entry).href);
  } else {
    try {
      mod = require(entry);
    } catch (e) {
      if (e && e.code === "ERR_REQUIRE_ESM") mod = await import(pathToFileURL(entry).href);
      else throw e;
    }
  }
  const handler = handlerOf(mod);
  if (!handler) return;
  const context = { function_id: process.env.CLADE_FUNCTION_ID, run_id: process.env.CLADE_RUN_ID };
  const result = await handler(event, context);
  if (result !== undefined) fs.writeFileSync(process.env.CLADE_OUTPUT, JSON.stringify(result));
}

main().catch((e) => {
  console.error(e && e.stack ? e.stack : String(e));
  process.exitCode = 1;
});
