// The end-to-end test worker (and the benchmark's): a Cloudflare-style module whose routes
// exercise env.AI.run through the real binding. Built with `bulkhead worker build`.
const TEXT = "@cf/huggingfacetb/smollm2-135m-instruct";
const EMBED = "@cf/sentence-transformers/all-minilm-l6-v2";

export default {
  async fetch(request, env, ctx) {
    const url = new URL(request.url);
    switch (url.pathname) {
      case "/echo":
        return new Response("ok");
      case "/text":
        // Any text model (?model=), on a raw prompt both families continue with "Berlin".
        return Response.json(
          await env.AI.run(url.searchParams.get("model") ?? TEXT, {
            prompt: "The capital of France is Paris. The capital of Germany is",
            raw: true,
            temperature: 0,
            max_tokens: 6,
          }),
        );
      case "/json":
        // Structured output (Workers AI's JSON mode): `response` is the object itself.
        return Response.json(
          await env.AI.run(TEXT, {
            messages: [{ role: "user", content: "Describe a big city in Europe." }],
            temperature: 1.0,
            seed: 7,
            max_tokens: 120,
            response_format: {
              type: "json_schema",
              json_schema: {
                type: "object",
                properties: {
                  city: { type: "string", maxLength: 24 },
                  country: { enum: ["France", "Italy", "Spain"] },
                },
                required: ["city", "country"],
                additionalProperties: false,
              },
            },
          }),
        );
      case "/tools": {
        // Function calling through env.AI.run: the model calls get_weather, the worker
        // runs it, and the model answers from its result.
        const tools = [
          {
            type: "function",
            function: {
              name: "get_weather",
              description: "The current weather in a city",
              parameters: {
                type: "object",
                properties: { city: { type: "string", maxLength: 24 } },
                required: ["city"],
                additionalProperties: false,
              },
            },
          },
        ];
        const messages = [{ role: "user", content: "What is the weather in Paris?" }];
        const first = await env.AI.run(TEXT, {
          messages,
          tools,
          tool_choice: "required",
          temperature: 0,
          max_tokens: 60,
        });
        const call = first.tool_calls[0];
        messages.push({
          role: "assistant",
          content: "",
          tool_calls: [{ id: call.id, type: "function", function: call.function }],
        });
        messages.push({
          role: "tool",
          tool_call_id: call.id,
          name: call.name,
          content: JSON.stringify({ city: call.arguments.city, temperature_c: 18 }),
        });
        const second = await env.AI.run(TEXT, {
          messages,
          tools,
          tool_choice: "none",
          temperature: 0,
          max_tokens: 40,
        });
        return Response.json({ call, answer: second.response, usage: second.usage });
      }
      case "/embed":
        return Response.json(await env.AI.run(EMBED, { text: ["hello", "world"] }));
      case "/embed-one":
        return Response.json(await env.AI.run(EMBED, { text: url.searchParams.get("q") ?? "hi" }));
      case "/stream": {
        const stream = await env.AI.run(TEXT, {
          prompt: "Name three colours.",
          temperature: 0,
          max_tokens: 16,
          stream: true,
        });
        return new Response(stream, { headers: { "content-type": "text/event-stream" } });
      }
      case "/oversized":
        try {
          await env.AI.run(TEXT, { prompt: "word ".repeat(2000), max_tokens: 8 });
          return new Response("the oversized prompt was accepted", { status: 500 });
        } catch (e) {
          return Response.json(
            { caught: e.message, name: e.name, code: e.code, status: e.status },
            { status: 422 },
          );
        }
      case "/raw":
        return env.AI.run("@cf/no/such-model", { prompt: "x" }, { returnRawResponse: true });
      case "/bad-option":
        try {
          await env.AI.run(EMBED, { text: "x" }, { gateway: { id: "g" } });
          return new Response("the option was ignored", { status: 500 });
        } catch (e) {
          return new Response(e.message, { status: 400 });
        }
      case "/fetch":
        try {
          const r = await fetch(request.headers.get("x-target"));
          return new Response(`fetched ${r.status}`, { status: 500 });
        } catch (e) {
          return new Response(`denied: ${e}`, { status: 403 });
        }
      case "/ambient":
        return Response.json({
          env: Object.keys(env),
          process: typeof process,
          fs: (() => {
            try {
              require("fs");
              return "loaded";
            } catch {
              return "unavailable";
            }
          })(),
        });
      case "/throw":
        throw new Error("boom");
      case "/not-a-response":
        return { hello: "world" };
      default:
        return new Response("not found", { status: 404 });
    }
  },
};
