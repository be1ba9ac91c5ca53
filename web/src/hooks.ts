import { useCallback, useEffect, useRef, useState } from "preact/hooks";

import { parseRoute, type Route } from "./logic";

export function useRoute(): Route {
  const [route, setRoute] = useState(() => parseRoute(location.hash));
  useEffect(() => {
    const on = () => setRoute(parseRoute(location.hash));
    window.addEventListener("hashchange", on);
    return () => window.removeEventListener("hashchange", on);
  }, []);
  return route;
}

export interface Loaded<T> {
  data: T | undefined;
  /** The last failure's readable message; earlier data stays shown. */
  error: string | null;
  loading: boolean;
  /** When the data last arrived (ms). */
  updatedAt: number;
  reload: () => Promise<void>;
}

/**
 * Loads with `fetcher` now and whenever `deps` change; with `intervalMs`, again on that
 * interval while `live` and the tab is visible.
 */
export function useLoad<T>(
  fetcher: () => Promise<T>,
  deps: unknown[],
  opts: { intervalMs?: number; live?: boolean } = {},
): Loaded<T> {
  const [data, setData] = useState<T | undefined>(undefined);
  const [error, setError] = useState<string | null>(null);
  const [loading, setLoading] = useState(true);
  const [updatedAt, setUpdatedAt] = useState(0);
  const seq = useRef(0);
  const fetcherRef = useRef(fetcher);
  fetcherRef.current = fetcher;

  const reload = useCallback(async () => {
    const mine = ++seq.current;
    setLoading(true);
    try {
      const d = await fetcherRef.current();
      if (mine !== seq.current) return;
      setData(d);
      setError(null);
      setUpdatedAt(Date.now());
    } catch (e) {
      if (mine !== seq.current) return;
      setError(e instanceof Error ? e.message : String(e));
    } finally {
      if (mine === seq.current) setLoading(false);
    }
  }, []);

  useEffect(() => {
    void reload();
    // eslint-disable-next-line react-hooks/exhaustive-deps
  }, deps);

  const { intervalMs, live = true } = opts;
  useEffect(() => {
    if (!intervalMs || !live) return;
    const id = window.setInterval(() => {
      if (document.visibilityState === "visible") void reload();
    }, intervalMs);
    return () => window.clearInterval(id);
  }, [intervalMs, live, reload]);

  return { data, error, loading, updatedAt, reload };
}

/** A clock that ticks every `ms`, for "5 s ago" labels. */
export function useNow(ms = 1000): number {
  const [now, setNow] = useState(Date.now());
  useEffect(() => {
    const id = window.setInterval(() => setNow(Date.now()), ms);
    return () => window.clearInterval(id);
  }, [ms]);
  return now;
}
