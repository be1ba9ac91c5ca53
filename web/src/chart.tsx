import {
  BarController,
  BarElement,
  CategoryScale,
  Chart,
  Legend,
  LinearScale,
  Tooltip,
  type ChartConfiguration,
} from "chart.js";
import { useEffect, useRef } from "preact/hooks";

import { formatInt } from "./logic";

Chart.register(BarController, BarElement, CategoryScale, LinearScale, Legend, Tooltip);
Chart.defaults.font.family = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif";
Chart.defaults.color = "#2f3640";

/** Colours with at least 3:1 contrast against white, told apart in the legend by name too. */
export const PALETTE = ["#1f5fbf", "#b45309", "#0f766e", "#9d174d", "#5b21b6", "#4d7c0f", "#374151", "#be123c"];

export interface Dataset {
  label: string;
  data: number[];
}

/**
 * A bar chart (chart.js) with its numbers also in a table for screen readers and for
 * anyone who wants them.
 */
export function BarChart(props: {
  title: string;
  labels: string[];
  datasets: Dataset[];
  stacked?: boolean;
  horizontal?: boolean;
}) {
  const canvas = useRef<HTMLCanvasElement>(null);
  const chart = useRef<Chart<"bar"> | null>(null);

  useEffect(() => {
    if (!canvas.current) return;
    const config: ChartConfiguration<"bar"> = {
      type: "bar",
      data: { labels: [], datasets: [] },
      options: {
        responsive: true,
        maintainAspectRatio: false,
        animation: false,
        indexAxis: props.horizontal ? "y" : "x",
        plugins: { legend: { position: "bottom" } },
        scales: {
          x: { stacked: props.stacked, grid: { display: false } },
          y: { stacked: props.stacked, beginAtZero: true, ticks: { precision: 0 } },
        },
      },
    };
    chart.current = new Chart(canvas.current, config);
    return () => {
      chart.current?.destroy();
      chart.current = null;
    };
  }, [props.stacked, props.horizontal]);

  useEffect(() => {
    const c = chart.current;
    if (!c) return;
    c.data.labels = props.labels;
    c.data.datasets = props.datasets.map((d, i) => ({
      label: d.label,
      data: d.data,
      backgroundColor: PALETTE[i % PALETTE.length],
      borderRadius: 2,
    }));
    c.update("none");
  }, [props.labels, props.datasets]);

  const total = props.datasets.reduce((s, d) => s + d.data.reduce((a, b) => a + b, 0), 0);
  return (
    <figure class="chart">
      <figcaption>{props.title}</figcaption>
      <div class="chart-box">
        <canvas ref={canvas} role="img" aria-label={`${props.title}: chart, ${formatInt(total)} in all; the table below has the numbers`} />
      </div>
      <details>
        <summary>Numbers of “{props.title}”</summary>
        <div class="table-wrap">
          <table>
            <thead>
              <tr>
                <th scope="col">{props.horizontal ? "" : "Day"}</th>
                {props.datasets.map((d) => (
                  <th scope="col" key={d.label}>
                    {d.label}
                  </th>
                ))}
              </tr>
            </thead>
            <tbody>
              {props.labels.map((l, i) => (
                <tr key={l}>
                  <th scope="row">{l}</th>
                  {props.datasets.map((d) => (
                    <td key={d.label} class="num">
                      {formatInt(d.data[i] ?? 0)}
                    </td>
                  ))}
                </tr>
              ))}
            </tbody>
          </table>
        </div>
      </details>
    </figure>
  );
}
