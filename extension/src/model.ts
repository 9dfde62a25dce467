/**
 * The data the server extension serves (one heartbeat per running session) and pure
 * functions over it: diffing two polls, finding the active notebook's session and
 * summarising for the status bar. No JupyterLab imports, so jest tests it directly.
 */

/** One memory tier as reported by the engine (bytes; null where unknown). */
export interface IMemoryTier {
  used_bytes?: number | null;
  peak_bytes?: number | null;
  capacity_bytes?: number | null;
  [key: string]: unknown;
}

export interface IMemory {
  device?: IMemoryTier;
  host?: IMemoryTier;
  disk?: IMemoryTier;
}

/** The outcome of the last command the session applied (written by the beacon). */
export interface ILastCommand {
  id: string;
  command?: string;
  value?: number | null;
  ok: boolean;
  error?: string | null;
  time: number;
}

/** One run of a session's tree (the session's own run, a fork, the steps a rewind left). */
export interface IBranch {
  /** null for a fork that has not trained yet. */
  run_id: string | null;
  name: string;
  parent_run_id: string | null;
  forked_at_step: number | null;
  /** The session's state, or "abandoned" (steps a rewind left behind). */
  state: string;
  step: number | null;
  loss: number | null;
  changes: string;
  /** The run this heartbeat's session trains now. */
  current: boolean;
}

/** A heartbeat, see docs/INTERNALS.md "Session beacon". */
export interface ISessionInfo {
  id: string;
  name: string;
  pid: number;
  host?: string;
  kernel_id: string | null;
  notebook: string | null;
  state: string;
  step: number | null;
  total_steps: number | null;
  loss: number | null;
  lr: number | null;
  /** A learning rate asked for and not applied yet (it applies at the next step). */
  requested_lr?: number | null;
  tokens_per_s?: number | null;
  /** A DPO run's reward margin and accuracy (TRL's rewards/margins, rewards/accuracies); absent otherwise. */
  reward_margin?: number | null;
  reward_accuracy?: number | null;
  loss_tail: Array<number | null>;
  memory: IMemory | null;
  last_command?: ILastCommand | null;
  started?: number;
  updated: number;
  /** Set when the run is over (finished, stopped, failed): kept in the list until dismissed. */
  ended?: number | null;
  age?: number;
  kernel_known?: boolean;
  /** Set by the server: the run's kernel is (or was, while this server ran) one of this server's. */
  here?: boolean;
  /** Set by the server for a run from elsewhere: where it comes from ("python train.py (pid 42)"). */
  origin_text?: string;
  /** The run's tree once it has branches (forks, rewinds); empty or absent otherwise. */
  branches?: IBranch[];
}

export interface ISessionList {
  sessions: ISessionInfo[];
  time: number;
}

export interface ISessionDiff {
  added: ISessionInfo[];
  updated: ISessionInfo[];
  removed: string[];
  unchanged: string[];
}

/** Fields that change on every heartbeat without anything visible changing. */
const VOLATILE = new Set(['updated', 'age']);

function fingerprint(s: ISessionInfo): string {
  return JSON.stringify(s, (key, value) => (VOLATILE.has(key) ? undefined : value));
}

/**
 * Compare two polls by session id. A session counts as updated only if something other
 * than its timestamps changed, so the view leaves untouched cards (and a half-typed
 * learning rate) alone.
 */
export function diffSessions(
  previous: readonly ISessionInfo[],
  next: readonly ISessionInfo[]
): ISessionDiff {
  const before = new Map(previous.map(s => [s.id, s]));
  const diff: ISessionDiff = { added: [], updated: [], removed: [], unchanged: [] };
  const seen = new Set<string>();
  for (const s of next) {
    seen.add(s.id);
    const old = before.get(s.id);
    if (!old) {
      diff.added.push(s);
    } else if (fingerprint(old) !== fingerprint(s)) {
      diff.updated.push(s);
    } else {
      diff.unchanged.push(s.id);
    }
  }
  for (const id of before.keys()) {
    if (!seen.has(id)) {
      diff.removed.push(id);
    }
  }
  return diff;
}

/** States in which a run still holds its training thread. */
export const ACTIVE_STATES = new Set(['running', 'paused', 'idle']);

/**
 * The session that belongs to a notebook: the one in its kernel (the most recently
 * started if several), else one whose notebook path matches.
 */
export function sessionForNotebook(
  sessions: readonly ISessionInfo[],
  kernelId: string | null | undefined,
  path: string | null | undefined
): ISessionInfo | null {
  const newest = (xs: ISessionInfo[]) =>
    xs.length ? xs.reduce((a, b) => ((b.started ?? 0) >= (a.started ?? 0) ? b : a)) : null;
  if (kernelId) {
    const inKernel = newest(sessions.filter(s => s.kernel_id === kernelId));
    if (inKernel) {
      return inKernel;
    }
  }
  if (path) {
    return newest(sessions.filter(s => s.notebook === path));
  }
  return null;
}

/** A run that is over and kept in the list until dismissed. */
export function isEnded(s: ISessionInfo): boolean {
  return typeof s.ended === 'number';
}

export interface ISummary {
  total: number;
  running: number;
  paused: number;
}

/** A run this server's kernels did not start (a script, torchrun, pytest, another server's kernel). */
export function isElsewhere(s: ISessionInfo): boolean {
  return s.here === false;
}

/** The count covers this server's runs (the ones from elsewhere are in their own group). */
export function summarize(all: readonly ISessionInfo[]): ISummary {
  const sessions = all.filter(s => !isElsewhere(s));
  return {
    total: sessions.filter(s => !isEnded(s)).length,
    running: sessions.filter(s => s.state === 'running').length,
    paused: sessions.filter(s => s.state === 'paused').length
  };
}
