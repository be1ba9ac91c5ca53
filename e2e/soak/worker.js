// The soak's worker: runs env.AI.run with the request's JSON body as the inputs of the model
// named by `?model=`, as the tenant that owns the worker. An AI error comes back with its own
// status and code (`{error, code, status}`), so the soak can tell it from a failure of the
// worker itself; a streamed answer is passed through as it comes.
export default {
  async fetch(request, env, ctx) {
    const url = new URL(request.url);
    if (url.pathname === "/echo") return new Response("ok");
    const model = url.searchParams.get("model");
    const inputs = await request.json();
    try {
      const out = await env.AI.run(model, inputs);
      if (inputs.stream) {
        return new Response(out, { headers: { "content-type": "text/event-stream" } });
      }
      return Response.json(out);
    } catch (e) {
      return Response.json(
        { error: String(e.message), code: e.code ?? null, status: e.status ?? null },
        { status: typeof e.status === "number" && e.status >= 400 ? e.status : 500 },
      );
    }
  },
};
