/** The sidebar DOM under jsdom: rendering, in-place updates and the controls. */

import { ICommandRequest } from '../commands';
import { SessionListView } from '../view';
import { session } from './helpers';

function setup() {
  const sent: Array<[string, ICommandRequest]> = [];
  const dismissed: string[] = [];
  let fail: string | null = null;
  const opened: string[] = [];
  const view = new SessionListView({
    send: async (id, req) => {
      sent.push([id, req]);
      if (fail) {
        throw new Error(fail);
      }
      return { id: `cmd-${sent.length}` };
    },
    openNotebook: path => opened.push(path),
    dismiss: async id => {
      dismissed.push(id);
    }
  });
  document.body.appendChild(view.node);
  const q = (sel: string) => view.node.querySelector(sel) as HTMLElement;
  return { view, sent, opened, dismissed, q, failWith: (m: string | null) => (fail = m) };
}

const flush = () => new Promise(r => setTimeout(r, 0));

afterEach(() => {
  document.body.innerHTML = '';
});

describe('SessionListView', () => {
  it('shows an empty message, then one card per session', () => {
    const { view, q } = setup();
    view.update({ sessions: [] });
    expect(q('.mtnb-empty').hidden).toBe(false);
    view.update({ sessions: [session(), session({ id: 'zz', name: 'second' })] });
    expect(q('.mtnb-empty').hidden).toBe(true);
    expect(view.node.querySelectorAll('.mtnb-session')).toHaveLength(2);
    expect(q('.mtnb-count').textContent).toBe('2');
  });

  it("shows a DPO run's reward margin, its accuracy on hover", () => {
    const { view, q } = setup();
    view.update({ sessions: [{ ...session(), reward_margin: 0.09712, reward_accuracy: 0.875 }] });
    expect(q('.mtnb-reward').textContent).toBe('margin 0.09712');
    expect(q('.mtnb-reward').title).toBe('reward accuracy 88%');
    view.update({ sessions: [{ ...session(), reward_margin: -0.0004 }] });
    expect(q('.mtnb-reward').textContent).toBe('margin -4.00e-4');
  });

  it('renders name, notebook, state, progress, loss, lr, sparkline and memory', () => {
    const { view, q } = setup();
    view.update({ sessions: [session()], activeId: 'abc123' });
    const card = q('.mtnb-session[data-session-id="abc123"]');
    expect(card.dataset.state).toBe('running');
    expect(card.classList.contains('mtnb-active')).toBe(true);
    expect(q('.mtnb-name').textContent).toBe('tiny-gpt');
    expect(q('.mtnb-notebook').textContent).toBe('notebooks/01-quickstart.ipynb');
    expect(q('.mtnb-state').textContent).toBe('running');
    expect(q('.mtnb-progress-text').textContent).toBe('12/100');
    expect(q('.mtnb-progress-fill').style.width).toBe('12.0%');
    expect(q('.mtnb-loss').textContent).toBe('loss 2.346');
    expect(q('.mtnb-lr').textContent).toBe('lr 3e-4');
    expect(q('.mtnb-reward').textContent).toBe('');   // not a DPO run
    expect(q('.mtnb-sparkline path').getAttribute('d')).toMatch(/^M[\d.]+ [\d.]+( L[\d.]+ [\d.]+){3}$/);
    expect(q('.mtnb-mem-device').textContent).toBe('2.00 GiB / 16.0 GiB (13%)');
    expect(q('.mtnb-mem-host').textContent).toBe('5.00 GiB');
    expect(q('.mtnb-mem-disk').textContent).toBe('0 B / 1.00 TiB (0%)');
    expect(q('.mtnb-pause').hidden).toBe(false);
    expect(q('.mtnb-resume').hidden).toBe(true);
  });

  it('names the kernel or pid when the notebook is unknown', () => {
    const { view, q } = setup();
    view.update({ sessions: [session({ notebook: null, kernel_id: '0123456789abcdef' })] });
    expect(q('.mtnb-notebook').textContent).toBe('kernel 01234567');
    view.update({ sessions: [session({ notebook: null, kernel_id: null, pid: 77 })] });
    expect(q('.mtnb-notebook').textContent).toBe('pid 77');
  });

  it('updates cards in place and drops sessions that disappeared', () => {
    const { view, q } = setup();
    view.update({ sessions: [session(), session({ id: 'other' })] });
    const card = q('.mtnb-session[data-session-id="abc123"]');
    const input = card.querySelector('.mtnb-lr-input') as HTMLInputElement;
    input.value = '1e-';
    view.update({ sessions: [session({ step: 50, state: 'paused' })] });
    expect(q('.mtnb-session[data-session-id="abc123"]')).toBe(card); // same node
    expect(input.value).toBe('1e-'); // half-typed value survives the poll
    expect(q('.mtnb-progress-text').textContent).toBe('50/100');
    expect(q('.mtnb-state').textContent).toBe('paused');
    expect(q('.mtnb-resume').hidden).toBe(false);
    expect(q('.mtnb-pause').hidden).toBe(true);
    expect(view.node.querySelector('[data-session-id="other"]')).toBeNull();
  });

  it('sends pause and shows it pending until the heartbeat confirms', async () => {
    const { view, q, sent } = setup();
    view.update({ sessions: [session()], now: Date.now() });
    q('.mtnb-pause').click();
    expect(sent).toEqual([['abc123', { command: 'pause', value: null }]]);
    expect(q('.mtnb-pending').textContent).toBe('pausing\u2026');
    expect((q('.mtnb-stop') as HTMLButtonElement).disabled).toBe(true);
    await flush();
    view.update({ sessions: [session({ step: 13 })] }); // not yet applied
    expect(q('.mtnb-pending').textContent).toBe('pausing\u2026');
    view.update({
      sessions: [session({ state: 'paused', last_command: { id: 'cmd-1', ok: true, time: 1 } })]
    });
    expect(q('.mtnb-pending').textContent).toBe('');
    expect(q('.mtnb-state').textContent).toBe('paused');
    expect(q('.mtnb-feedback').textContent).toBe('');
  });

  it("shows the session's error when a command failed there", async () => {
    const { view, q } = setup();
    view.update({ sessions: [session()] });
    q('.mtnb-pause').click();
    await flush();
    view.update({
      sessions: [session({ last_command: { id: 'cmd-1', ok: false, error: 'RuntimeError: no', time: 1 } })]
    });
    expect(q('.mtnb-feedback').textContent).toBe('RuntimeError: no');
    expect(q('.mtnb-feedback').classList.contains('mtnb-feedback-error')).toBe(true);
  });

  it('shows a refused request and re-enables the controls', async () => {
    const { view, q, failWith } = setup();
    view.update({ sessions: [session()] });
    failWith('no running megatrain_nb session with id abc123');
    q('.mtnb-pause').click();
    await flush();
    expect(q('.mtnb-feedback').textContent).toContain('no running megatrain_nb session');
    expect((q('.mtnb-pause') as HTMLButtonElement).disabled).toBe(false);
  });

  it('asks for a second click before stopping', async () => {
    const { view, q, sent } = setup();
    view.update({ sessions: [session()] });
    q('.mtnb-stop').click();
    expect(sent).toEqual([]);
    expect(q('.mtnb-stop').textContent).toBe('Confirm stop');
    q('.mtnb-stop').click();
    expect(sent).toEqual([['abc123', { command: 'stop', value: null }]]);
  });

  it('validates the learning rate before sending it', async () => {
    const { view, q, sent } = setup();
    view.update({ sessions: [session()] });
    const input = q('.mtnb-lr-input') as HTMLInputElement;
    expect(input.placeholder).toBe('lr 3e-4');
    input.value = 'fast';
    q('.mtnb-lr-set').click();
    expect(sent).toEqual([]);
    expect(input.classList.contains('mtnb-invalid')).toBe(true);
    expect(q('.mtnb-feedback').textContent).toContain('not a number');
    input.value = '1e-4';
    input.dispatchEvent(new KeyboardEvent('keydown', { key: 'Enter' }));
    expect(sent).toEqual([['abc123', { command: 'lr', value: 1e-4 }]]);
    await flush();
    expect(input.value).toBe('');
  });

  it('disables controls once the run is over', () => {
    const { view, q } = setup();
    view.update({ sessions: [session({ state: 'finished' })] });
    for (const sel of ['.mtnb-pause', '.mtnb-stop', '.mtnb-lr-set']) {
      expect((q(sel) as HTMLButtonElement).disabled).toBe(true);
    }
  });

  it('shows a polling error instead of the empty message', () => {
    const { view, q } = setup();
    view.update({ sessions: [], error: 'server extension is not enabled' });
    expect(q('.mtnb-error').hidden).toBe(false);
    expect(q('.mtnb-error').textContent).toBe('server extension is not enabled');
    expect(q('.mtnb-empty').hidden).toBe(true);
  });

  it('opens the notebook from its link', () => {
    const { view, q, opened } = setup();
    view.update({ sessions: [session()] });
    q('.mtnb-notebook').click();
    expect(opened).toEqual(['notebooks/01-quickstart.ipynb']);
  });

  it('confirms a learning rate the session took and shows it until the next step applies it', async () => {
    const { view, q, sent } = setup();
    view.update({ sessions: [session({ state: 'paused', lr: 2e-3 })] });
    const input = q('.mtnb-lr-input') as HTMLInputElement;
    input.value = '5e-4';
    q('.mtnb-lr-set').click();
    expect(sent).toEqual([['abc123', { command: 'lr', value: 5e-4 }]]);
    await flush();
    // the beacon applied it (paused: the run's lr changes at the next step)
    view.update({
      sessions: [
        session({
          state: 'paused',
          lr: 2e-3,
          requested_lr: 5e-4,
          last_command: { id: 'cmd-1', command: 'lr', value: 5e-4, ok: true, time: 1 }
        })
      ]
    });
    expect(q('.mtnb-feedback').textContent).toBe('Learning rate 5e-4 from the next step.');
    expect(q('.mtnb-feedback').classList.contains('mtnb-feedback-ok')).toBe(true);
    expect(q('.mtnb-lr').textContent).toBe('lr 2e-3 \u2192 5e-4 next step');
    view.update({ sessions: [session({ state: 'running', lr: 5e-4, requested_lr: 5e-4 })] });
    expect(q('.mtnb-lr').textContent).toBe('lr 5e-4');
  });

  it('keeps a run that ended, with its final loss, until it is dismissed', async () => {
    const { view, q, dismissed } = setup();
    view.update({ sessions: [session({ state: 'finished', ended: 3000, step: 100, loss: 1.5 })] });
    const card = q('.mtnb-session');
    expect(card.classList.contains('mtnb-ended')).toBe(true);
    expect(q('.mtnb-state').textContent).toBe('finished');
    expect(q('.mtnb-loss').textContent).toBe('final loss 1.5');
    expect(q('.mtnb-stop').hidden).toBe(true);
    expect(q('.mtnb-lr-box').style.display).toBe('none');
    expect(q('.mtnb-dismiss').hidden).toBe(false);
    q('.mtnb-dismiss').click();
    await flush();
    expect(dismissed).toEqual(['abc123']);
    // a running card has no Dismiss
    view.update({ sessions: [session({ id: 'live' })] });
    expect((view.node.querySelector('.mtnb-dismiss') as HTMLElement).hidden).toBe(true);
  });
});
