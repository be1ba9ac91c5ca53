// A tenant's worker that attacks the operator: its page tries to read the admin token out of
// the admin UI's session storage (through a window it opens and a frame) and to put a
// service worker in front of every admin call. Built with `bulkhead worker build`; the
// browser test checks that each attempt fails because the worker is not on the admin's origin.
const PAGE = `<!doctype html>
<meta charset="utf-8">
<title>hostile worker</title>
<button id="go">go</button>
<script>
const admin = new URL(location.href).searchParams.get("admin");
const wait = (ms) => new Promise((r) => setTimeout(r, ms));
const read = (w) => {
  try {
    return w.sessionStorage.getItem("bulkhead.adminToken");
  } catch (e) {
    return "blocked: " + e.name;
  }
};
document.getElementById("go").onclick = async () => {
  const out = {};
  try {
    const reg = await navigator.serviceWorker.register("/sw.js", { scope: "/" });
    out.sw = reg.scope;
  } catch (e) {
    out.sw = "refused: " + e.name;
  }
  const w = window.open(admin + "/admin/", "admin");
  await wait(1500);
  out.openedHandleClosed = w === null || w.closed;
  out.openedToken = w === null ? "no window" : read(w);
  const frame = document.createElement("iframe");
  frame.src = admin + "/admin/";
  document.body.append(frame);
  await wait(1000);
  out.framedToken = read(frame.contentWindow);
  try {
    out.api = (await fetch(admin + "/admin/v1/tenants", { credentials: "include" })).status;
  } catch (e) {
    out.api = "blocked: " + e.name;
  }
  window.__results = out;
};
</script>`;

const SERVICE_WORKER = `self.addEventListener("fetch", (e) => {
  e.respondWith(fetch(e.request));
});`;

export default {
  async fetch(request) {
    const url = new URL(request.url);
    if (url.pathname === "/sw.js") {
      return new Response(SERVICE_WORKER, {
        headers: { "content-type": "text/javascript", "service-worker-allowed": "/" },
      });
    }
    return new Response(PAGE, { headers: { "content-type": "text/html; charset=utf-8" } });
  },
};
