// The admin API client: same origin, bearer token from session storage, the
// {result, success, errors, messages} envelope unwrapped, failures as readable errors.

import { describeFailure } from "./logic";

const TOKEN_KEY = "bulkhead.adminToken";

/** The admin token lives in session storage only: it goes when the tab closes. */
export const session = {
  token(): string | null {
    try {
      return sessionStorage.getItem(TOKEN_KEY);
    } catch {
      return null;
    }
  },
  signIn(token: string): void {
    sessionStorage.setItem(TOKEN_KEY, token);
  },
  signOut(): void {
    sessionStorage.removeItem(TOKEN_KEY);
  },
};

export class ApiError extends Error {
  /** HTTP status, 0 when the control plane could not be reached. */
  readonly status: number;
  /** The envelope's numeric error code, when there is one. */
  readonly code: number | undefined;
  constructor(status: number, message: string, code?: number) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.code = code;
  }
}

/** Fired when the admin API refuses the token (401): the app signs out. */
export const UNAUTHORIZED_EVENT = "bulkhead:unauthorized";

export async function api<T>(
  method: "GET" | "POST" | "PATCH" | "DELETE",
  path: string,
  body?: unknown,
  token: string | null = session.token(),
): Promise<T> {
  const headers: Record<string, string> = { Accept: "application/json" };
  if (token) headers.Authorization = `Bearer ${token}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let res: Response;
  try {
    res = await fetch(`/admin/v1${path}`, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store",
    });
  } catch (e) {
    throw new ApiError(0, describeFailure(0, "", String(e instanceof Error ? e.message : e)).message);
  }
  const text = await res.text();
  let parsed: unknown = undefined;
  try {
    parsed = text ? JSON.parse(text) : undefined;
  } catch {
    parsed = undefined;
  }
  const envelope = parsed as { success?: boolean; result?: T } | undefined;
  if (res.ok && envelope && envelope.success !== false) {
    return envelope.result as T;
  }
  const failure = describeFailure(res.status, res.statusText, parsed ?? text);
  // A refused session token signs the app out (not a token being tried at sign-in).
  if (res.status === 401 && token !== null && token === session.token()) {
    window.dispatchEvent(new CustomEvent(UNAUTHORIZED_EVENT, { detail: failure.message }));
  }
  throw new ApiError(res.status, failure.message, failure.code);
}

/** Path segment for a model name (`@cf/a/b` → `@cf%2Fa%2Fb`). */
export function modelPath(name: string): string {
  return encodeURIComponent(name);
}

export function query(params: Record<string, string | number | undefined | null>): string {
  const q = new URLSearchParams();
  for (const [k, v] of Object.entries(params)) {
    if (v !== undefined && v !== null && v !== "") q.set(k, String(v));
  }
  const s = q.toString();
  return s ? `?${s}` : "";
}
