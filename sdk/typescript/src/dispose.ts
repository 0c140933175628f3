/**
 * `Symbol.asyncDispose` for runtimes that lack it (Node < 18.18, older
 * Bun/Deno), so `await using sb = await client.sandboxes.create()` works
 * wherever TypeScript's downlevelled `using` runs. The registered symbol is
 * the one other polyfills use too.
 */

const symbolConstructor = Symbol as unknown as { asyncDispose?: symbol };
if (typeof symbolConstructor.asyncDispose !== 'symbol') {
  try {
    Object.defineProperty(Symbol, 'asyncDispose', { value: Symbol.for('Symbol.asyncDispose') });
  } catch {
    // A frozen Symbol: nothing to do; `await using` is unavailable there.
  }
}

export {};
