/// <reference types="vitest/config" />
import { defineConfig } from "vite";

// Node's environment, without pulling in @types/node for one variable.
const env = (globalThis as { process?: { env: Record<string, string | undefined> } }).process?.env ?? {};

// Served by the platform at /admin/ (same origin as the admin API at /admin/v1/).
export default defineConfig({
  base: "/admin/",
  oxc: { jsx: { runtime: "automatic", importSource: "preact" } },
  // `npm run dev`: the UI at http://localhost:5173/admin/, the admin API of a running
  // `bulkhead serve` (BULKHEAD_URL, default http://127.0.0.1:8787) behind it.
  server: {
    proxy: { "/admin/v1": env.BULKHEAD_URL ?? "http://127.0.0.1:8787" },
  },
  build: {
    outDir: "dist",
    emptyOutDir: true,
    target: "es2022",
    chunkSizeWarningLimit: 400,
  },
  test: {
    include: ["src/**/*.test.ts"],
    environment: "node",
  },
});
