import type { ComponentChildren } from "preact";
import { useId, useLayoutEffect, useRef } from "preact/hooks";

import { relativeTime } from "./logic";

/**
 * A modal dialog on the native <dialog>: focus moves into it, Escape closes it, the page
 * behind is inert, and focus returns to where it was when it closes.
 */
export function Dialog(props: {
  title: string;
  onClose: () => void;
  children: ComponentChildren;
}) {
  const ref = useRef<HTMLDialogElement>(null);
  const id = useId();
  useLayoutEffect(() => {
    const d = ref.current;
    const before = document.activeElement as HTMLElement | null;
    if (d && !d.open) d.showModal();
    return () => {
      if (d?.open) d.close();
      if (before?.isConnected) before.focus();
    };
  }, []);
  return (
    <dialog
      ref={ref}
      class="dialog"
      aria-labelledby={`${id}-title`}
      onCancel={(e) => {
        e.preventDefault();
        props.onClose();
      }}
    >
      <h2 id={`${id}-title`}>{props.title}</h2>
      {props.children}
    </dialog>
  );
}

/** A public/private switch: a button with role="switch", operated with Enter or Space. */
export function Switch(props: {
  checked: boolean;
  label: string;
  onToggle: () => void;
  disabled?: boolean;
  describedBy?: string;
  onText?: string;
  offText?: string;
}) {
  return (
    <button
      type="button"
      role="switch"
      class="switch"
      aria-checked={props.checked}
      aria-label={props.label}
      aria-describedby={props.describedBy}
      disabled={props.disabled}
      onClick={props.onToggle}
    >
      <span class="switch-track" aria-hidden="true">
        <span class="switch-thumb" />
      </span>
      <span class="switch-text">{props.checked ? props.onText ?? "On" : props.offText ?? "Off"}</span>
    </button>
  );
}

export function ErrorBanner(props: { message: string | null; onRetry?: () => void }) {
  if (!props.message) return null;
  return (
    <div role="alert" class="banner banner-error">
      <span>{props.message}</span>
      {props.onRetry && (
        <button type="button" class="button-small" onClick={props.onRetry}>
          Retry
        </button>
      )}
    </div>
  );
}

export function Notice(props: { message: string | null }) {
  return (
    <div role="status" class={props.message ? "banner banner-ok" : "visually-hidden"}>
      {props.message}
    </div>
  );
}

/** "Updated 3 s ago" with a checkbox to pause live refresh. */
export function LiveControl(props: {
  live: boolean;
  setLive: (v: boolean) => void;
  updatedAt: number;
  now: number;
  everySeconds: number;
}) {
  const id = useId();
  return (
    <div class="live">
      <input
        id={id}
        type="checkbox"
        checked={props.live}
        onChange={(e) => props.setLive((e.currentTarget as HTMLInputElement).checked)}
      />
      <label for={id}>Refresh every {props.everySeconds} s</label>
      <span class="muted" aria-live="off">
        {" "}
        · updated {relativeTime(props.updatedAt, props.now)}
      </span>
    </div>
  );
}

export function PageHeader(props: { title: string; children?: ComponentChildren }) {
  return (
    <div class="page-header">
      <h1 id="page-title" tabIndex={-1}>
        {props.title}
      </h1>
      <div class="page-header-extra">{props.children}</div>
    </div>
  );
}
