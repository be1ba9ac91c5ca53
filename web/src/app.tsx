import { useEffect, useErrorBoundary, useId, useState } from "preact/hooks";

import { api, session, UNAUTHORIZED_EVENT } from "./api";
import { ErrorBanner } from "./components";
import { useRoute } from "./hooks";
import { routeHref, type Page } from "./logic";
import { AuditPage } from "./pages/Audit";
import { CatalogPage } from "./pages/Catalog";
import { NodesPage } from "./pages/Nodes";
import { TenantsPage } from "./pages/Tenants";
import { UsagePage } from "./pages/Usage";

const NAV: { page: Page; label: string }[] = [
  { page: "catalog", label: "Catalog" },
  { page: "nodes", label: "Nodes" },
  { page: "tenants", label: "Tenants & tokens" },
  { page: "usage", label: "Usage" },
  { page: "audit", label: "Audit log" },
];

export function App() {
  const [token, setToken] = useState(session.token());
  const [signedOutWhy, setSignedOutWhy] = useState<string | null>(null);

  useEffect(() => {
    const on = (e: Event) => {
      session.signOut();
      setToken(null);
      setSignedOutWhy(`${(e as CustomEvent<string>).detail}. Sign in again.`);
    };
    window.addEventListener(UNAUTHORIZED_EVENT, on);
    return () => window.removeEventListener(UNAUTHORIZED_EVENT, on);
  }, []);

  if (!token) {
    return (
      <SignIn
        message={signedOutWhy}
        onSignedIn={(t) => {
          session.signIn(t);
          setSignedOutWhy(null);
          setToken(t);
        }}
      />
    );
  }
  return (
    <Shell
      onSignOut={() => {
        session.signOut();
        setSignedOutWhy(null);
        setToken(null);
      }}
    />
  );
}

function SignIn(props: { message: string | null; onSignedIn: (token: string) => void }) {
  const [value, setValue] = useState("");
  const [error, setError] = useState<string | null>(null);
  const [busy, setBusy] = useState(false);
  const id = useId();
  async function submit(e: Event) {
    e.preventDefault();
    const t = value.trim();
    if (!t) {
      setError("Enter the admin token.");
      return;
    }
    setBusy(true);
    setError(null);
    try {
      // Check the token before keeping it.
      await api("GET", "/tenants", undefined, t);
      props.onSignedIn(t);
    } catch (err) {
      setError(err instanceof Error ? err.message : String(err));
      setBusy(false);
    }
  }
  return (
    <main id="main" class="signin">
      <form class="card" onSubmit={submit} noValidate aria-labelledby={`${id}-h`}>
        <h1 id={`${id}-h`}>Bulkhead admin</h1>
        <p class="muted">
          Sign in with the admin token (<code>BULKHEAD_ADMIN_TOKEN</code>, or the one <code>bulkhead serve</code> printed
          on first boot). It is kept in this tab's session storage only.
        </p>
        <ErrorBanner message={error ?? props.message} />
        <div class="field">
          <label for={`${id}-token`}>Admin token</label>
          <input
            id={`${id}-token`}
            type="password"
            autocomplete="off"
            spellcheck={false}
            value={value}
            onInput={(e) => setValue((e.currentTarget as HTMLInputElement).value)}
            autofocus
          />
        </div>
        <button type="submit" class="primary" disabled={busy}>
          Sign in
        </button>
      </form>
    </main>
  );
}

function Shell(props: { onSignOut: () => void }) {
  const route = useRoute();
  const [crash, resetCrash] = useErrorBoundary();
  useEffect(() => {
    document.title = `${NAV.find((n) => n.page === route.page)?.label ?? "Admin"} · Bulkhead admin`;
    // Move focus to the new page's heading, so that keyboard and screen-reader users land there.
    const h = document.getElementById("page-title");
    if (h && document.activeElement?.closest("nav")) h.focus();
  }, [route.page]);
  useEffect(() => {
    if (crash) resetCrash();
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, [route.page]);

  const setParams = (page: Page, params: Record<string, string>) => {
    location.hash = routeHref(page, params);
  };

  let content;
  if (crash) {
    content = (
      <ErrorBanner
        message={`This page failed to render: ${crash instanceof Error ? crash.message : String(crash)}`}
        onRetry={resetCrash}
      />
    );
  } else {
    switch (route.page) {
      case "nodes":
        content = <NodesPage />;
        break;
      case "tenants":
        content = (
          <TenantsPage selected={route.params.get("tenant")} onSelect={(id) => setParams("tenants", { tenant: id })} />
        );
        break;
      case "usage":
        content = <UsagePage initialTenant={route.params.get("tenant")} initialModel={route.params.get("model")} />;
        break;
      case "audit":
        content = (
          <AuditPage
            model={route.params.get("model") ?? ""}
            tenant={route.params.get("tenant") ?? ""}
            onFilter={(f) => setParams("audit", f)}
          />
        );
        break;
      default:
        content = <CatalogPage />;
    }
  }

  return (
    <>
      <a class="skip" href="#main" onClick={(e) => (e.preventDefault(), document.getElementById("main")?.focus())}>
        Skip to content
      </a>
      <header class="top">
        <span class="brand">Bulkhead admin</span>
        <nav aria-label="Sections">
          <ul>
            {NAV.map((n) => (
              <li key={n.page}>
                <a href={routeHref(n.page)} aria-current={route.page === n.page ? "page" : undefined}>
                  {n.label}
                </a>
              </li>
            ))}
          </ul>
        </nav>
        <button type="button" class="signout" onClick={props.onSignOut}>
          Sign out
        </button>
      </header>
      <main id="main" tabIndex={-1}>
        {content}
      </main>
    </>
  );
}
