/**
 * Where each session's card goes in the sidebar, from one poll: pure functions, tested by jest.
 *
 * - Forks are Sessions of their own, each with a heartbeat; sessions sharing a run tree (their
 *   branch rows share a root run) make one card, the first started, with the others nested in
 *   it (`children`). The tree's rows come from the member whose heartbeat is newest (a parent
 *   that finished stopped writing before its later forks existed).
 * - Top-level cards whose runs are all over go to the `finished` group, newest end first; the
 *   others (`live`) list running ones first, then the newest started.
 * - Cards whose runs all come from elsewhere (not this server's kernels: scripts, torchrun,
 *   pytest, another server) go to the `elsewhere` group, running first, then the newest.
 */

import { IBranch, isElsewhere, isEnded, ISessionInfo } from './model';

export interface ILayout {
  live: string[];
  finished: string[];
  elsewhere: string[];
  children: Map<string, string[]>;
  rows: Map<string, IBranch[] | undefined>;
}

/** The run a session's tree starts at (its own id when it has no branches). */
export function treeRoot(s: ISessionInfo): string {
  const rows = s.branches ?? [];
  const byId = new Map(rows.filter(r => r.run_id).map(r => [r.run_id as string, r]));
  let at = rows.find(r => r.current) ?? rows[0];
  if (!at) {
    return `session:${s.id}`;
  }
  const seen = new Set<IBranch>();
  while (at.parent_run_id && byId.has(at.parent_run_id) && !seen.has(at)) {
    seen.add(at);
    at = byId.get(at.parent_run_id)!;
  }
  return at.run_id ? `run:${at.run_id}` : `session:${s.id}`;
}

export function layoutSessions(sessions: readonly ISessionInfo[]): ILayout {
  const groups = new Map<string, ISessionInfo[]>();
  for (const s of sessions) {
    const key = treeRoot(s);
    groups.set(key, [...(groups.get(key) ?? []), s]);
  }
  const children = new Map<string, string[]>();
  const rows = new Map<string, IBranch[] | undefined>();
  const tops: ISessionInfo[][] = [];
  for (const members of groups.values()) {
    const byStart = members.slice().sort((a, b) => (a.started ?? 0) - (b.started ?? 0) || a.id.localeCompare(b.id));
    const owner = byStart[0];
    const freshest = members.reduce((a, b) => ((b.updated ?? 0) > (a.updated ?? 0) ? b : a));
    rows.set(owner.id, freshest.branches ?? owner.branches);
    children.set(owner.id, byStart.slice(1).map(s => s.id));
    tops.push(byStart);
  }
  const over = (g: ISessionInfo[]) => g.every(isEnded);
  const running = (g: ISessionInfo[]) => g.some(s => s.state === 'running' && !isEnded(s));
  const newest = (g: ISessionInfo[]) => Math.max(...g.map(s => s.started ?? 0));
  const lastEnd = (g: ISessionInfo[]) => Math.max(...g.map(s => s.ended ?? 0));
  const away = (g: ISessionInfo[]) => g.every(isElsewhere);
  const liveFirst = (a: ISessionInfo[], b: ISessionInfo[]) =>
    Number(running(b)) - Number(running(a)) || newest(b) - newest(a);
  const live = tops
    .filter(g => !away(g) && !over(g))
    .sort(liveFirst)
    .map(g => g[0].id);
  const finished = tops
    .filter(g => !away(g) && over(g))
    .sort((a, b) => lastEnd(b) - lastEnd(a))
    .map(g => g[0].id);
  const elsewhere = tops
    .filter(away)
    .sort(liveFirst)
    .map(g => g[0].id);
  return { live, finished, elsewhere, children, rows };
}
