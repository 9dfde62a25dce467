/** Where the sidebar puts each card (layout.ts) and the list that follows it (issue 36: the
 * running card sat under 16 finished ones, a fork got a top-level card its parent did not list). */

import { layoutSessions, treeRoot } from '../layout';
import { IBranch, ISessionInfo } from '../model';
import { SessionListView } from '../view';
import { session } from './helpers';

function row(over: Partial<IBranch>): IBranch {
  return { run_id: 'r0', name: 'main', parent_run_id: null, forked_at_step: null, state: 'finished', step: 10,
    loss: 2.5, changes: '', current: false, ...over };
}

const MAIN_ROWS = [row({ run_id: 'r0', name: 'main', current: true })];
const FORK_ROWS = [
  row({ run_id: 'r0', name: 'main' }),
  row({ run_id: 'f1', name: 'low-lr', parent_run_id: 'r0', forked_at_step: 25, state: 'running', current: true })
];

function many(): ISessionInfo[] {
  const out: ISessionInfo[] = [];
  for (let i = 0; i < 16; i++) {
    out.push(session({ id: `old${i}`, name: `old-${i}`, state: 'finished', started: 100 + i, ended: 200 + i }));
  }
  out.push(session({ id: 'paused1', name: 'paused', state: 'paused', started: 500 }));
  out.push(session({ id: 'run1', name: 'running-old', state: 'running', started: 300 }));
  out.push(session({ id: 'run2', name: 'running-new', state: 'running', started: 900 }));
  return out;
}

describe('layoutSessions', () => {
  it('puts running cards first, then the newest, and every finished one in the group, newest first', () => {
    const l = layoutSessions(many());
    expect(l.live).toEqual(['run2', 'run1', 'paused1']);
    expect(l.finished[0]).toBe('old15');
    expect(l.finished).toHaveLength(16);
  });

  it('nests a fork under the run it came from, with the newest heartbeat\'s tree', () => {
    const main = session({ id: 'm', name: 'main', state: 'finished', ended: 50, started: 10, updated: 50,
      branches: MAIN_ROWS });
    const fork = session({ id: 'f', name: 'low-lr', state: 'running', started: 60, updated: 90, branches: FORK_ROWS });
    expect(treeRoot(main)).toBe(treeRoot(fork));
    const l = layoutSessions([fork, main]);
    expect(l.live).toEqual(['m']); // not over while its fork runs
    expect(l.children.get('m')).toEqual(['f']);
    expect(l.rows.get('m')).toBe(FORK_ROWS);
  });
});

describe('the sidebar at scale', () => {
  const setup = () => {
    const dismissed: string[] = [];
    const view = new SessionListView({
      send: async () => ({ id: 'c' }),
      dismiss: async id => {
        dismissed.push(id);
      }
    });
    document.body.appendChild(view.node);
    return { view, dismissed };
  };

  it('shows the running card at the top and folds the finished ones into one group', () => {
    const { view, dismissed } = setup();
    view.update({ sessions: many() });
    const top = Array.from(view.node.querySelectorAll('.mtnb-sessions:not(.mtnb-sessions-finished) > .mtnb-session'));
    expect(top.map(n => (n as HTMLElement).dataset.sessionId)).toEqual(['run2', 'run1', 'paused1']);
    const group = view.node.querySelector('.mtnb-finished') as HTMLDetailsElement;
    expect(group.hidden).toBe(false);
    expect(group.open).toBe(false);
    expect(group.querySelector('.mtnb-finished-count')!.textContent).toBe('16 finished');
    expect(group.querySelectorAll('.mtnb-session')).toHaveLength(16);
    (group.querySelector('.mtnb-dismiss-all') as HTMLButtonElement).click();
    expect(dismissed.sort()).toEqual(many().filter(s => s.ended).map(s => s.id).sort());
    document.body.innerHTML = '';
  });

  it('lists a fork in its parent\'s card, not as a card of its own at the top', () => {
    const { view } = setup();
    const main = session({ id: 'm', name: 'main', state: 'finished', ended: 50, started: 10, updated: 50,
      branches: MAIN_ROWS });
    const fork = session({ id: 'f', name: 'low-lr', state: 'running', started: 60, updated: 90, branches: FORK_ROWS });
    view.update({ sessions: [main, fork] });
    const top = view.node.querySelectorAll('.mtnb-sessions > .mtnb-session');
    expect(top).toHaveLength(1);
    const card = top[0] as HTMLElement;
    expect(card.dataset.sessionId).toBe('m');
    expect(Array.from(card.querySelectorAll(':scope > .mtnb-branches .mtnb-branch-name')).map(n => n.textContent))
      .toEqual(['main', '\u2514 low-lr']);
    expect((card.querySelector('.mtnb-forks > .mtnb-session') as HTMLElement).dataset.sessionId).toBe('f');
    // the branch row carries its whole text for when the sidebar is too narrow
    const forkRow = card.querySelector(':scope > .mtnb-branches [data-run-id="f1"]') as HTMLElement;
    expect(forkRow.title).toContain('low-lr');
    expect(forkRow.title).toContain('from step 25');
    document.body.innerHTML = '';
  });

  it('keeps one finished run open when nothing else is there', () => {
    const { view } = setup();
    view.update({ sessions: [session({ id: 'x', state: 'stopped', ended: 5 })] });
    expect((view.node.querySelector('.mtnb-finished') as HTMLDetailsElement).open).toBe(true);
    document.body.innerHTML = '';
  });
});

describe('the finished group', () => {
  it('unfolds on a click and stays as the user left it across polls', () => {
    const view = new SessionListView({ send: async () => ({ id: 'c' }), dismiss: async () => undefined });
    document.body.appendChild(view.node);
    view.update({ sessions: many() });
    const group = view.node.querySelector('.mtnb-finished') as HTMLDetailsElement;
    expect(group.open).toBe(false);
    (group.querySelector('.mtnb-finished-summary') as HTMLElement).click();
    expect(group.open).toBe(true);
    view.update({ sessions: many() });
    expect(group.open).toBe(true);
    document.body.innerHTML = '';
  });
});

describe('runs from elsewhere (issue 46 item 1)', () => {
  const away = (over: Partial<ISessionInfo>) =>
    session({ here: false, origin_text: 'python train.py (pid 42)', kernel_id: null, ...over });

  it("lists this server's runs first and the others in their own group, running first", () => {
    const here = session({ id: 'h1', here: true, state: 'running', started: 10 });
    const done = session({ id: 'h2', here: true, state: 'finished', started: 5, ended: 8 });
    const script = away({ id: 'e1', state: 'running', started: 1 });
    const test = away({ id: 'e2', state: 'finished', started: 50, ended: 60, origin_text: 'pytest (pid 7)' });
    const l = layoutSessions([test, script, done, here]);
    expect(l.live).toEqual(['h1']);
    expect(l.finished).toEqual(['h2']);
    expect(l.elsewhere).toEqual(['e1', 'e2']);
  });

  it('folds them, says where each comes from, and leaves them out of the count', () => {
    const view = new SessionListView({ send: async () => ({ id: 'c' }) });
    document.body.appendChild(view.node);
    view.update({ sessions: [away({ id: 'e1', state: 'running' }), session({ id: 'h1', here: true })] });
    const group = view.node.querySelector('.mtnb-elsewhere') as HTMLDetailsElement;
    expect(group.hidden).toBe(false);
    expect(group.open).toBe(false);
    expect(group.querySelector('.mtnb-elsewhere-count')!.textContent).toBe('1 from elsewhere');
    const card = group.querySelector('.mtnb-session') as HTMLElement;
    expect(card.dataset.sessionId).toBe('e1');
    expect(card.querySelector('.mtnb-notebook')!.textContent).toBe('from python train.py (pid 42)');
    expect(view.node.querySelector('.mtnb-count')!.textContent).toBe('1');
    const top = view.node.querySelectorAll('.mtnb-sessions:not(.mtnb-sessions-finished):not(.mtnb-sessions-elsewhere) > .mtnb-session');
    expect(Array.from(top).map(n => (n as HTMLElement).dataset.sessionId)).toEqual(['h1']);
    view.update({ sessions: [session({ id: 'h1', here: true })] });
    expect(group.hidden).toBe(true);
    document.body.innerHTML = '';
  });
});
