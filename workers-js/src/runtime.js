// The Cloudflare-style surface of a Bulkhead JS worker, bundled in front of the tenant's
// module by `bulkhead worker build`:
//
//   export default {
//     async fetch(request, env, ctx) {
//       const out = await env.AI.run("@cf/huggingfacetb/smollm2-135m-instruct", { prompt: "hi" });
//       return Response.json(out);           // { response, tool_calls, usage }
//     },
//   };
//
// `env.AI.run(model, inputs, options)` is workerd's binding: it resolves to the unwrapped
// `result` (text `{response, usage}`, embeddings `{shape, data}`), to a `ReadableStream` of
// the REST API's server-sent-event bytes for `stream: true`, and rejects with an `Error`
// whose message starts with the Workers AI code (`5021: ...`), with `code` and `status`
// set. `options.returnRawResponse: true` resolves to the REST `Response` instead (errors
// included, with their status). Other options are refused by the host, not ignored.
import { run, runStream } from "bulkhead:ai/ai@0.1.0";
import { uncaught } from "bulkhead:ai/runtime@0.1.0";

/** The ai-error record of a failed host call, whichever way the bindings threw it. */
function payloadOf(e) {
  if (e && typeof e === "object") {
    if (e.payload && typeof e.payload === "object" && "code" in e.payload) return e.payload;
    if ("code" in e && "message" in e && "status" in e) return e;
  }
  return null;
}

/** An AI binding error as workerd throws it: the message starts with the numeric code. */
export class AiError extends Error {
  constructor({ status, code, message }) {
    super(`${code}: ${message}`);
    this.name = "AiError";
    this.code = code;
    this.status = status;
  }
}

function toError(e) {
  const p = payloadOf(e);
  return p ? new AiError(p) : e;
}

function errorResponse(e) {
  const p = payloadOf(e);
  if (!p) throw e;
  const body = { result: {}, success: false, errors: [{ code: p.code, message: p.message }], messages: [] };
  return new Response(JSON.stringify(body), {
    status: p.status,
    headers: { "content-type": "application/json" },
  });
}

function byteStream(handle) {
  return new ReadableStream({
    pull(controller) {
      const chunk = handle.read();
      if (chunk === undefined || chunk === null) {
        controller.close();
      } else {
        controller.enqueue(chunk);
      }
    },
  });
}

/** `env.AI`. */
export class Ai {
  async run(model, inputs, options = {}) {
    if (typeof model !== "string") throw new TypeError("AI.run: model must be a string");
    if (inputs === null || typeof inputs !== "object") {
      throw new TypeError("AI.run: inputs must be an object");
    }
    if (options === null || typeof options !== "object") {
      throw new TypeError("AI.run: options must be an object");
    }
    const raw = options.returnRawResponse === true;
    const body = JSON.stringify(inputs);
    const opts = JSON.stringify(options);
    if (inputs.stream === true) {
      let handle;
      try {
        handle = runStream(model, body, opts);
      } catch (e) {
        if (raw) return errorResponse(e);
        throw toError(e);
      }
      const stream = byteStream(handle);
      return raw
        ? new Response(stream, { headers: { "content-type": "text/event-stream" } })
        : stream;
    }
    let out;
    try {
      out = run(model, body, opts);
    } catch (e) {
      if (raw) return errorResponse(e);
      throw toError(e);
    }
    if (raw) {
      const envelope = `{"result":${out},"success":true,"errors":[],"messages":[]}`;
      return new Response(envelope, { headers: { "content-type": "application/json" } });
    }
    return JSON.parse(out);
  }
}

/** Serves `worker` (the tenant module's default export) on the fetch event. */
export function serve(worker) {
  const env = Object.freeze({ AI: new Ai() });
  // An uncaught exception is reported to the host, which ends the request as 500/1101 and
  // counts it (the engine's own answer would be a plain 500 the host cannot tell from one
  // the worker meant). The report traps the guest, so nothing runs after it.
  const fail = (e) => {
    const message = e && e.stack ? `${e}\n${e.stack}` : String(e);
    console.error(`uncaught: ${message}`);
    uncaught(message);
    throw e;
  };
  const checked = (response) => {
    if (!(response instanceof Response)) fail(new TypeError("fetch() must return a Response"));
    return response;
  };
  addEventListener("fetch", (event) => {
    const ctx = {
      waitUntil: (p) => event.waitUntil(p),
      passThroughOnException() {},
    };
    // One promise on top of the handler's own (SpiderMonkey records a stack for every
    // promise it makes), none when the handler answers a Response synchronously.
    // `Promise.resolve` hands back a native promise as it is and adopts any other thenable.
    try {
      const handler = worker && worker.fetch;
      if (typeof handler !== "function") {
        throw new TypeError("the worker's default export has no fetch(request, env, ctx) method");
      }
      const answer = handler.call(worker, event.request, env, ctx);
      event.respondWith(
        answer instanceof Response ? answer : Promise.resolve(answer).then(checked, fail),
      );
    } catch (e) {
      fail(e);
    }
  });
}
