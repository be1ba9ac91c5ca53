/// <reference types="vitest/config" />
import { defineConfig } from "vite";

// Served by the platform at /admin/ (same origin as the admin API at /admin/v1/).
export default defineConfig({
  base: "/admin/",
  oxc: { jsx: { runtime: "automatic", importSource: "preact" } },
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
