/**
 * A session's branches, nested under the run they came from: the heartbeat's `branches`
 * rows (one per run of the tree) ordered depth first, each child under its parent, siblings
 * by the step they were forked at. Plain DOM, tested under jsdom.
 *
 * Hooks: ul.mtnb-branches > li.mtnb-branch[data-run-id][data-depth][data-state] (class
 * mtnb-branch-current for the session's own run) with .mtnb-branch-name, .mtnb-branch-state,
 * .mtnb-branch-from ("from step N"), .mtnb-branch-loss and .mtnb-branch-changes.
 */

import { formatLoss } from './format';
import { IBranch } from './model';

export interface INestedBranch {
  branch: IBranch;
  depth: number;
}

/** Depth-first order: roots (no parent among the rows) first, each child under its parent. */
export function nestBranches(rows: readonly IBranch[]): INestedBranch[] {
  const ids = new Set(rows.filter(r => r.run_id).map(r => r.run_id));
  const children = new Map<string | null, IBranch[]>();
  for (const r of rows) {
    const parent = r.parent_run_id && ids.has(r.parent_run_id) && r.parent_run_id !== r.run_id ? r.parent_run_id : null;
    const list = children.get(parent) ?? [];
    list.push(r);
    children.set(parent, list);
  }
  const out: INestedBranch[] = [];
  const seen = new Set<IBranch>();
  const visit = (parent: string | null, depth: number) => {
    const kids = (children.get(parent) ?? []).slice().sort((a, b) => (a.forked_at_step ?? -1) - (b.forked_at_step ?? -1));
    for (const k of kids) {
      if (seen.has(k)) {
        continue;
      }
      seen.add(k);
      out.push({ branch: k, depth });
      if (k.run_id) {
        visit(k.run_id, depth + 1);
      }
    }
  };
  visit(null, 0);
  for (const r of rows) {
    if (!seen.has(r)) {
      out.push({ branch: r, depth: 0 }); // (a cycle among the parents: listed flat, never lost)
    }
  }
  return out;
}

function span(doc: Document, cls: string, text: string): HTMLSpanElement {
  const s = doc.createElement('span');
  s.className = cls;
  s.textContent = text;
  return s;
}

/** Replace `ul`'s items by the branches of `rows` (hidden when there are none). */
export function renderBranches(doc: Document, ul: HTMLElement, rows: readonly IBranch[] | undefined): void {
  const nested = nestBranches(rows ?? []);
  ul.hidden = nested.length === 0;
  ul.replaceChildren(
    ...nested.map(({ branch: b, depth }) => {
      const li = doc.createElement('li');
      li.className = `mtnb-branch${b.current ? ' mtnb-branch-current' : ''}`;
      li.dataset.runId = b.run_id ?? '';
      li.dataset.depth = String(depth);
      li.dataset.state = b.state;
      li.style.paddingLeft = `${depth * 12}px`;
      li.append(
        span(doc, 'mtnb-branch-name', `${depth ? '\u2514 ' : ''}${b.name}`),
        span(doc, `mtnb-branch-state mtnb-state-${b.state}`, b.state),
        span(doc, 'mtnb-branch-from', b.forked_at_step === null || b.forked_at_step === undefined ? '' : `from step ${b.forked_at_step}`),
        span(doc, 'mtnb-branch-loss', b.loss === null || b.loss === undefined ? '' : `loss ${formatLoss(b.loss)}`),
        span(doc, 'mtnb-branch-changes', b.changes ?? '')
      );
      // the whole row on hover: at the sidebar's width a long name or change list is cut short
      li.title = [
        b.name,
        b.state,
        b.forked_at_step === null || b.forked_at_step === undefined ? '' : `from step ${b.forked_at_step}`,
        b.loss === null || b.loss === undefined ? '' : `loss ${formatLoss(b.loss)}`,
        b.changes ?? '',
        `run ${b.run_id ?? '(not started)'}${b.step === null || b.step === undefined ? '' : ` \u00b7 step ${b.step}`}`
      ].filter(Boolean).join(' \u00b7 ');
      return li;
    })
  );
}
