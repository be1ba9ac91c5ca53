// `bulkhead worker build WORKER.js -o WORKER.wasm` runs this: bundle the tenant's module
// behind src/runtime.js with esbuild (the AI binding stays an import of the component),
// then componentize-js turns it into a component of the `bulkhead:ai/worker` world in
// ../wit: SpiderMonkey with the script pre-initialised (Wizer), exporting
// wasi:http/incoming-handler and importing bulkhead:ai/ai. Fully offline.
import { build } from "esbuild";
import { componentize } from "@bytecodealliance/componentize-js";
import { mkdtemp, rm, writeFile } from "node:fs/promises";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
const args = process.argv.slice(2);
const o = args.indexOf("-o");
if (args.length !== 3 || o < 0 || o === args.length - 1) {
  console.error("usage: node build.mjs WORKER.js -o WORKER.wasm");
  process.exit(2);
}
const output = resolve(args[o + 1]);
const input = resolve(args.filter((_, i) => i !== o && i !== o + 1)[0]);

const started = Date.now();
const bundled = await build({
  stdin: {
    contents:
      `import worker from ${JSON.stringify(input)};\n` +
      `import { serve } from ${JSON.stringify(join(here, "src/runtime.js"))};\n` +
      `serve(worker);\n`,
    resolveDir: dirname(input),
    sourcefile: "bulkhead-entry.js",
    loader: "js",
  },
  bundle: true,
  format: "esm",
  platform: "neutral",
  target: "es2022",
  external: ["bulkhead:*", "wasi:*"],
  write: false,
  logLevel: "error",
});
const dir = await mkdtemp(join(tmpdir(), "bulkhead-worker-"));
try {
  const source = join(dir, "worker.js");
  await writeFile(source, bundled.outputFiles[0].text);
  const { component } = await componentize({
    sourcePath: source,
    witPath: resolve(here, "../wit"),
    worldName: "worker",
  });
  await writeFile(output, component);
  const secs = ((Date.now() - started) / 1000).toFixed(1);
  console.error(`built ${output} (${component.length} bytes) in ${secs} s`);
} finally {
  await rm(dir, { recursive: true, force: true });
}
