/** A session's branches nested under their run (branches.ts, and the card that shows them). */

import { nestBranches, renderBranches } from '../branches';
import { IBranch } from '../model';
import { SessionListView } from '../view';
import { session } from './helpers';

function branch(over: Partial<IBranch>): IBranch {
  return {
    run_id: 'r0',
    name: 'main',
    parent_run_id: null,
    forked_at_step: null,
    state: 'running',
    step: 10,
    loss: 2.5,
    changes: '',
    current: false,
    ...over
  };
}

const TREE: IBranch[] = [
  branch({ run_id: 'late', name: 'late-fork', parent_run_id: 'r0', forked_at_step: 8, state: 'paused' }),
  branch({ run_id: 'r0', name: 'main (abandoned after step 4)', state: 'abandoned' }),
  branch({ run_id: 'r1', name: 'main', parent_run_id: 'r0', forked_at_step: 4, current: true, changes: 'rewound to step 4' }),
  branch({ run_id: 'g1', name: 'grandchild', parent_run_id: 'r1', forked_at_step: 6, loss: null, changes: 'learning_rate=0.0001' }),
  branch({ run_id: null, name: 'not-started', parent_run_id: 'late', forked_at_step: 9, state: 'idle', step: null })
];

describe('nestBranches', () => {
  it('orders depth first, each child under its parent, siblings by fork step', () => {
    expect(nestBranches(TREE).map(n => [n.branch.name, n.depth])).toEqual([
      ['main (abandoned after step 4)', 0],
      ['main', 1],
      ['grandchild', 2],
      ['late-fork', 1],
      ['not-started', 2]
    ]);
  });

  it('never loses a row: unknown parents are roots, a cycle is listed flat', () => {
    const rows = [
      branch({ run_id: 'a', parent_run_id: 'b' }),
      branch({ run_id: 'b', parent_run_id: 'a' }),
      branch({ run_id: 'c', parent_run_id: 'gone' })
    ];
    const got = nestBranches(rows);
    expect(got.map(n => n.branch.run_id).sort()).toEqual(['a', 'b', 'c']);
    expect(got.find(n => n.branch.run_id === 'c')?.depth).toBe(0);
  });
});

describe('the card', () => {
  it('lists the branches under the run, and hides the list without branches', () => {
    const view = new SessionListView({ send: async () => ({ id: 'x' }) });
    document.body.appendChild(view.node);
    view.update({ sessions: [session({ branches: TREE })] });
    const items = Array.from(view.node.querySelectorAll('.mtnb-session .mtnb-branches .mtnb-branch')) as HTMLElement[];
    expect(items.map(li => [li.dataset.runId, li.dataset.depth, li.dataset.state])).toEqual([
      ['r0', '0', 'abandoned'],
      ['r1', '1', 'running'],
      ['g1', '2', 'running'],
      ['late', '1', 'paused'],
      ['', '2', 'idle']
    ]);
    const current = view.node.querySelector('.mtnb-branch-current') as HTMLElement;
    expect(current.dataset.runId).toBe('r1');
    expect(current.querySelector('.mtnb-branch-from')?.textContent).toBe('from step 4');
    expect(current.querySelector('.mtnb-branch-loss')?.textContent).toBe('loss 2.5');
    expect(items[2].querySelector('.mtnb-branch-changes')?.textContent).toBe('learning_rate=0.0001');
    expect(items[2].querySelector('.mtnb-branch-loss')?.textContent).toBe('');
    const ul = view.node.querySelector('.mtnb-branches') as HTMLElement;
    expect(ul.hidden).toBe(false);
    view.update({ sessions: [session({ branches: [] })] });
    expect(ul.hidden).toBe(true);
    expect(ul.children).toHaveLength(0);
    document.body.innerHTML = '';
  });

  it('renders into any list, replacing what was there', () => {
    const ul = document.createElement('ul');
    renderBranches(document, ul, TREE.slice(1, 3));
    renderBranches(document, ul, TREE.slice(1, 3));
    expect(ul.children).toHaveLength(2);
  });
});
