/** Text for numbers shown in the sidebar and the status bar. Pure functions. */

import { IMemoryTier, ISessionInfo, summarize } from './model';

const DASH = '\u2014';

function isNum(x: unknown): x is number {
  return typeof x === 'number' && Number.isFinite(x);
}

/** 1536 -> "1.5 KiB"; null -> "—". Binary units, as the engine reports capacities. */
export function formatBytes(n: number | null | undefined): string {
  if (!isNum(n) || n < 0) {
    return DASH;
  }
  const units = ['B', 'KiB', 'MiB', 'GiB', 'TiB', 'PiB'];
  let i = 0;
  let v = n;
  while (v >= 1024 && i < units.length - 1) {
    v /= 1024;
    i++;
  }
  const digits = i === 0 || v >= 100 ? 0 : v >= 10 ? 1 : 2;
  return `${v.toFixed(digits)} ${units[i]}`;
}

/** "1.2 GiB / 16 GiB (8%)", "1.2 GiB" when the capacity is unknown, "—" when nothing is. */
export function formatTier(tier: IMemoryTier | null | undefined): string {
  if (!tier || !isNum(tier.used_bytes)) {
    return DASH;
  }
  const used = formatBytes(tier.used_bytes);
  if (!isNum(tier.capacity_bytes) || tier.capacity_bytes <= 0) {
    return used;
  }
  const pct = Math.round((100 * tier.used_bytes) / tier.capacity_bytes);
  return `${used} / ${formatBytes(tier.capacity_bytes)} (${pct}%)`;
}

/** Four significant digits without exponent noise: 2.34567 -> "2.346". */
export function formatLoss(x: number | null | undefined): string {
  if (!isNum(x)) {
    return DASH;
  }
  if (x !== 0 && (Math.abs(x) >= 1e5 || Math.abs(x) < 1e-3)) {
    return x.toExponential(2);
  }
  return Number(x.toPrecision(4)).toString();
}

/** Learning rates read best in exponent form: 0.0003 -> "3e-4", 0.00025 -> "2.5e-4". */
export function formatLr(x: number | null | undefined): string {
  if (!isNum(x)) {
    return DASH;
  }
  return Number(x.toPrecision(3))
    .toExponential()
    .replace(/\.?0+e/, 'e')
    .replace('e+', 'e');
}

/** "12/100" or "12" (total unknown) or "—". */
export function formatProgress(
  step: number | null | undefined,
  total: number | null | undefined
): string {
  if (!isNum(step)) {
    return DASH;
  }
  return isNum(total) && total > 0 ? `${step}/${total}` : `${step}`;
}

/** Fraction done in [0, 1], or null when the total is unknown. */
export function progressFraction(
  step: number | null | undefined,
  total: number | null | undefined
): number | null {
  if (!isNum(step) || !isNum(total) || total <= 0) {
    return null;
  }
  return Math.min(1, Math.max(0, step / total));
}

/**
 * The status bar text: the count, then the active notebook's run by its name, with its step
 * ("MegaTrain: 1 running · sft-1 step 52/200 · loss 2.3"); a run not running says
 * its state once ("sft-1 finished at step 30/30", "sft-1 paused at step 12/100").
 */
export function statusText(
  sessions: readonly ISessionInfo[],
  active: ISessionInfo | null
): string {
  const { total, running } = summarize(sessions);
  const count = `MegaTrain: ${running} running${total > running ? ` / ${total}` : ''}`;
  if (!active) {
    return count;
  }
  const step = `step ${formatProgress(active.step, active.total_steps)}`;
  const where = active.state === 'running' ? step : `${active.state} at ${step}`;
  const parts = [count, `${active.name || active.id} ${where}`];
  if (isNum(active.loss)) {
    parts.push(`loss ${formatLoss(active.loss)}`);
  }
  return parts.join(' \u00b7 ');
}
