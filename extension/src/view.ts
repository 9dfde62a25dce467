/**
 * The sidebar's DOM: one card per session, updated in place on every poll so that a
 * half-typed learning rate or an armed stop button survives the refresh. Plain DOM (no
 * Lumino, no React) so jest can drive it under jsdom.
 *
 * Stable hooks for tests and styling: .mtnb-session[data-session-id][data-state],
 * .mtnb-name, .mtnb-state, .mtnb-pending, .mtnb-notebook, .mtnb-progress-text,
 * .mtnb-loss, .mtnb-lr, .mtnb-sparkline, .mtnb-mem-{device,host,disk}, .mtnb-pause,
 * .mtnb-resume, .mtnb-stop, .mtnb-lr-input, .mtnb-lr-set, .mtnb-feedback, .mtnb-dismiss, and the
 * run's branches nested under it (.mtnb-branches, see branches.ts).
 *
 * Order (layout.ts): running cards first, then the newest; a fork's card nested in the card
 * of the run it came from (.mtnb-forks); runs that are all over in one group
 * (details.mtnb-finished, "N finished", .mtnb-dismiss-all), collapsed once there is a live run
 * or more than three of them; runs from elsewhere (not this server's kernels: scripts, torchrun,
 * pytest, another server) in their own folded group (details.mtnb-elsewhere, "N from elsewhere"),
 * each card saying where it comes from (.mtnb-notebook: "from python train.py (pid 42)"). A run that ended stays as a card (state
 * "finished"/"stopped"/"failed", final loss, class .mtnb-ended) until its Dismiss button removes
 * it (or the server forgets it: its process gone for a while). A learning rate that was asked for and
 * not applied yet shows next to the current one ("lr 2e-3 → 5e-4 next step"), and a Set LR
 * the session took is confirmed in the card's feedback line.
 */

import { renderBranches } from './branches';
import { layoutSessions } from './layout';
import {
  controlsFor,
  ICommandRequest,
  IPending,
  makeCommand,
  parseLearningRate,
  PENDING_LABELS,
  settle
} from './commands';
import {
  formatLoss,
  formatLr,
  formatProgress,
  formatTier,
  progressFraction
} from './format';
import { diffSessions, IBranch, isElsewhere, isEnded, ISessionInfo } from './model';
import { sparkline } from './sparkline';

export interface IViewActions {
  /** Send a command; resolves with the server's command id. */
  send(sessionId: string, request: ICommandRequest): Promise<{ id: string }>;
  /** Open a notebook by path (the card's notebook link). */
  openNotebook?(path: string): void;
  /** Remove a run that ended from the list. */
  dismiss?(sessionId: string): Promise<void>;
}

export interface IViewState {
  sessions: ISessionInfo[];
  error?: string | null;
  activeId?: string | null;
  now?: number;
}

const SPARK_W = 220;
const SPARK_H = 36;
const SVG_NS = 'http://www.w3.org/2000/svg';
const STOP_CONFIRM_MS = 3000;

function el<K extends keyof HTMLElementTagNameMap>(
  doc: Document,
  tag: K,
  className: string,
  text?: string
): HTMLElementTagNameMap[K] {
  const node = doc.createElement(tag);
  node.className = className;
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

function setText(node: Element, text: string): void {
  if (node.textContent !== text) {
    node.textContent = text;
  }
}

export class SessionListView {
  readonly node: HTMLElement;
  private _cards = new Map<string, SessionCard>();
  private _list: HTMLElement;
  private _empty: HTMLElement;
  private _error: HTMLElement;
  private _count: HTMLElement;
  private _sessions: ISessionInfo[] = [];
  private _finished: HTMLDetailsElement;
  private _finishedList: HTMLElement;
  private _finishedCount: HTMLElement;
  private _finishedIds: string[] = [];
  private _userToggled = false;
  /** Runs from elsewhere (scripts, torchrun, pytest, another server): folded, below. */
  private _elsewhere: HTMLDetailsElement;
  private _elsewhereList: HTMLElement;
  private _elsewhereCount: HTMLElement;

  constructor(
    private _actions: IViewActions,
    private _doc: Document = document
  ) {
    this.node = el(_doc, 'div', 'mtnb-panel');
    this.node.dataset.testid = 'mtnb-panel';
    const header = el(_doc, 'div', 'mtnb-header');
    header.appendChild(el(_doc, 'span', 'mtnb-title', 'Training sessions'));
    this._count = el(_doc, 'span', 'mtnb-count', '0');
    header.appendChild(this._count);
    this._error = el(_doc, 'div', 'mtnb-error');
    this._error.hidden = true;
    this._empty = el(
      _doc,
      'div',
      'mtnb-empty',
      'No megatrain_nb session is training on this server. Start one with session.train().'
    );
    this._list = el(_doc, 'ul', 'mtnb-sessions');
    this._finished = el(_doc, 'details', 'mtnb-finished');
    this._finished.hidden = true;
    const summary = el(_doc, 'summary', 'mtnb-finished-summary');
    this._finishedCount = el(_doc, 'span', 'mtnb-finished-count');
    const all = el(_doc, 'button', 'mtnb-button mtnb-dismiss-all', 'Dismiss all');
    all.type = 'button';
    all.title = 'Remove every run that ended from the list';
    all.addEventListener('click', ev => {
      ev.preventDefault(); // (a click in the summary would also fold the group)
      this._dismissAll();
    });
    summary.addEventListener('click', ev => {
      // folded or unfolded by the user from now on (the poll no longer decides)
      ev.preventDefault();
      this._userToggled = true;
      this._finished.open = !this._finished.open;
    });
    summary.append(this._finishedCount, all);
    this._finishedList = el(_doc, 'ul', 'mtnb-sessions mtnb-sessions-finished');
    this._finished.append(summary, this._finishedList);
    this._elsewhere = el(_doc, 'details', 'mtnb-elsewhere');
    this._elsewhere.hidden = true;
    const away = el(_doc, 'summary', 'mtnb-elsewhere-summary');
    this._elsewhereCount = el(_doc, 'span', 'mtnb-elsewhere-count');
    away.title = 'Runs not started by this server\'s kernels: scripts, torchrun, pytest, another server';
    away.appendChild(this._elsewhereCount);
    this._elsewhereList = el(_doc, 'ul', 'mtnb-sessions mtnb-sessions-elsewhere');
    this._elsewhere.append(away, this._elsewhereList);
    this.node.append(header, this._error, this._empty, this._list, this._finished, this._elsewhere);
  }

  get cardCount(): number {
    return this._cards.size;
  }

  update(state: IViewState): void {
    const now = state.now ?? Date.now();
    const diff = diffSessions(this._sessions, state.sessions);
    for (const id of diff.removed) {
      this._cards.get(id)?.node.remove();
      this._cards.delete(id);
    }
    for (const s of diff.added) {
      this._cards.set(s.id, new SessionCard(s, this._actions, this._doc));
    }
    const layout = layoutSessions(state.sessions);
    const nested = new Set([...layout.children.values()].flat());
    for (const s of state.sessions) {
      const card = this._cards.get(s.id)!;
      // a nested fork shows no tree of its own: its parent's card lists it
      card.update(s, now, s.id === state.activeId, nested.has(s.id) ? [] : layout.rows.get(s.id));
    }
    this._order(this._list, layout.live);
    this._order(this._finishedList, layout.finished);
    this._order(this._elsewhereList, layout.elsewhere);
    this._elsewhere.hidden = layout.elsewhere.length === 0;
    setText(this._elsewhereCount, `${layout.elsewhere.length} from elsewhere`);
    for (const [parent, kids] of layout.children) {
      this._order(this._cards.get(parent)!.forks, kids);
    }
    this._finishedIds = [...layout.finished, ...layout.finished.flatMap(id => layout.children.get(id) ?? [])];
    if (!layout.finished.length) {
      this._userToggled = false;
    }
    if (!this._userToggled) {
      this._finished.open = layout.live.length === 0 && layout.finished.length <= 3;
    }
    this._finished.hidden = layout.finished.length === 0;
    setText(this._finishedCount, `${layout.finished.length} finished`);
    this._sessions = state.sessions;

    const here = state.sessions.filter(s => !isElsewhere(s)).length;
    setText(this._count, String(here));
    this._empty.hidden = here > 0 || !!state.error;
    this._error.hidden = !state.error;
    setText(this._error, state.error ?? '');
  }

  /** Put these cards in `list`, in this order, touching the DOM only if something changed. */
  private _order(list: HTMLElement, ids: string[]): void {
    const current = Array.from(list.children).map(n => (n as HTMLElement).dataset.sessionId);
    if (current.length === ids.length && current.every((id, i) => id === ids[i])) {
      return;
    }
    for (const id of ids) {
      list.appendChild(this._cards.get(id)!.node);
    }
  }

  private _dismissAll(): void {
    const dismiss = this._actions.dismiss;
    if (!dismiss) {
      return;
    }
    for (const id of this._finishedIds) {
      void dismiss(id).catch(() => undefined); // (a run gone already: nothing to do)
    }
  }

  dispose(): void {
    for (const card of this._cards.values()) {
      card.dispose();
    }
    this._cards.clear();
    this.node.remove();
  }
}

class SessionCard {
  readonly node: HTMLLIElement;
  private _session: ISessionInfo;
  private _pending: IPending | null = null;
  private _stopArmed: number | null = null;
  private _branchKey = '';
  /** The cards of forks of this run, nested in it. */
  readonly forks: HTMLElement;
  private _n: Record<string, HTMLElement> = {};
  private _spark: SVGPathElement;
  private _sparkSvg: SVGSVGElement;
  private _lrInput: HTMLInputElement;

  constructor(
    session: ISessionInfo,
    private _actions: IViewActions,
    private _doc: Document
  ) {
    this._session = session;
    const d = _doc;
    const li = (this.node = el(d, 'li', 'mtnb-session'));
    li.dataset.sessionId = session.id;
    li.dataset.testid = 'mtnb-session';

    const n = this._n;
    const title = el(d, 'div', 'mtnb-session-title');
    n.name = el(d, 'span', 'mtnb-name');
    n.state = el(d, 'span', 'mtnb-state');
    n.state.dataset.testid = 'mtnb-state';
    n.pending = el(d, 'span', 'mtnb-pending');
    title.append(n.name, n.state, n.pending);

    n.notebook = el(d, 'div', 'mtnb-notebook');
    n.notebook.addEventListener('click', () => {
      const path = this._session.notebook;
      if (path && this._actions.openNotebook) {
        this._actions.openNotebook(path);
      }
    });

    const progress = el(d, 'div', 'mtnb-progress');
    const bar = el(d, 'div', 'mtnb-progress-bar');
    n.fill = el(d, 'div', 'mtnb-progress-fill');
    bar.appendChild(n.fill);
    n.progress = el(d, 'span', 'mtnb-progress-text');
    progress.append(bar, n.progress);

    const metrics = el(d, 'div', 'mtnb-metrics');
    n.loss = el(d, 'span', 'mtnb-loss');
    n.lr = el(d, 'span', 'mtnb-lr');
    n.speed = el(d, 'span', 'mtnb-speed');
    n.reward = el(d, 'span', 'mtnb-reward');   // a DPO run: its reward margin
    metrics.append(n.loss, n.lr, n.speed, n.reward);

    this._sparkSvg = d.createElementNS(SVG_NS, 'svg') as SVGSVGElement;
    this._sparkSvg.setAttribute('class', 'mtnb-sparkline');
    this._sparkSvg.setAttribute('viewBox', `0 0 ${SPARK_W} ${SPARK_H}`);
    this._sparkSvg.setAttribute('preserveAspectRatio', 'none');
    this._spark = d.createElementNS(SVG_NS, 'path') as SVGPathElement;
    this._sparkSvg.appendChild(this._spark);

    const mem = el(d, 'dl', 'mtnb-memory');
    for (const tier of ['device', 'host', 'disk']) {
      mem.appendChild(el(d, 'dt', 'mtnb-mem-label', tier));
      n[`mem_${tier}`] = el(d, 'dd', `mtnb-mem-${tier}`);
      mem.appendChild(n[`mem_${tier}`]);
    }

    const controls = el(d, 'div', 'mtnb-controls');
    n.pause = this._button('mtnb-pause', 'Pause', () => this._send('pause'));
    n.resume = this._button('mtnb-resume', 'Resume', () => this._send('resume'));
    n.stop = this._button('mtnb-stop', 'Stop', () => this._onStop());
    const lrBox = el(d, 'span', 'mtnb-lr-box');
    this._lrInput = el(d, 'input', 'mtnb-lr-input');
    this._lrInput.type = 'text';
    this._lrInput.spellcheck = false;
    this._lrInput.setAttribute('aria-label', 'New learning rate');
    this._lrInput.addEventListener('keydown', ev => {
      if (ev.key === 'Enter') {
        this._onSetLr();
      }
    });
    this._lrInput.addEventListener('input', () => this._lrInput.classList.remove('mtnb-invalid'));
    n.lrSet = this._button('mtnb-lr-set', 'Set LR', () => this._onSetLr());
    lrBox.append(this._lrInput, n.lrSet);
    controls.append(n.pause, n.resume, n.stop, lrBox);
    n.dismiss = this._button('mtnb-dismiss', 'Dismiss', () => this._onDismiss());
    n.dismiss.title = 'Remove this run that ended from the list';
    controls.append(n.dismiss);

    n.feedback = el(d, 'div', 'mtnb-feedback');
    n.branches = el(d, 'ul', 'mtnb-branches');
    n.branches.hidden = true;
    n.meta = el(d, 'div', 'mtnb-meta');

    this.forks = el(d, 'ul', 'mtnb-forks');
    li.append(title, n.notebook, progress, metrics, this._sparkSvg, mem, controls, n.feedback, n.branches, n.meta,
      this.forks);
  }

  private _button(cls: string, label: string, onClick: () => void): HTMLButtonElement {
    const b = el(this._doc, 'button', `mtnb-button ${cls}`, label);
    b.type = 'button';
    b.dataset.testid = cls;
    b.addEventListener('click', onClick);
    return b;
  }

  update(s: ISessionInfo, now: number, active: boolean, rows?: IBranch[]): void {
    this._session = s;
    const n = this._n;
    this.node.dataset.state = s.state;
    this.node.classList.toggle('mtnb-active', active);
    setText(n.name, s.name);
    n.name.title = `session ${s.id}`;
    setText(n.state, s.state);
    n.state.className = `mtnb-state mtnb-state-${s.state}`;

    const where = s.origin_text
      ? `from ${s.origin_text}`
      : (s.notebook ?? (s.kernel_id ? `kernel ${s.kernel_id.slice(0, 8)}` : `pid ${s.pid}`));
    setText(n.notebook, where);
    n.notebook.title = s.notebook ?? '';
    n.notebook.classList.toggle('mtnb-link', !!(s.notebook && this._actions.openNotebook));

    setText(n.progress, formatProgress(s.step, s.total_steps));
    const frac = progressFraction(s.step, s.total_steps);
    n.fill.style.width = frac === null ? '0%' : `${(frac * 100).toFixed(1)}%`;
    const ended = isEnded(s);
    this.node.classList.toggle('mtnb-ended', ended);
    setText(n.loss, `${ended ? 'final loss' : 'loss'} ${formatLoss(s.loss)}`);
    const requested = s.requested_lr;
    const pendingLr =
      !ended && typeof requested === 'number' && typeof s.lr === 'number' && formatLr(requested) !== formatLr(s.lr);
    setText(n.lr, pendingLr ? `lr ${formatLr(s.lr)} \u2192 ${formatLr(requested)} next step` : `lr ${formatLr(s.lr)}`);
    n.lr.classList.toggle('mtnb-lr-pending', pendingLr);
    setText(
      n.speed,
      typeof s.tokens_per_s === 'number' ? `${Math.round(s.tokens_per_s)} tok/s` : ''
    );

    setText(n.reward, typeof s.reward_margin === 'number' ? `margin ${formatLoss(s.reward_margin)}` : '');
    n.reward.title =
      typeof s.reward_accuracy === 'number' ? `reward accuracy ${Math.round(s.reward_accuracy * 100)}%` : '';

    const spark = sparkline(s.loss_tail ?? [], SPARK_W, SPARK_H, 2);
    if (this._spark.getAttribute('d') !== spark.d) {
      this._spark.setAttribute('d', spark.d);
    }
    this._sparkSvg.setAttribute(
      'aria-label',
      spark.min === null ? 'no loss yet' : `loss ${formatLoss(spark.min)}\u2013${formatLoss(spark.max)}`
    );

    for (const tier of ['device', 'host', 'disk'] as const) {
      setText(n[`mem_${tier}`], formatTier(s.memory?.[tier]));
    }
    const tree = rows ?? s.branches;
    const branches = JSON.stringify(tree ?? []);
    if (this._branchKey !== branches) {
      this._branchKey = branches;
      renderBranches(this._doc, n.branches, tree);
    }
    setText(n.meta, `pid ${s.pid}${s.host ? ` @ ${s.host}` : ''} \u00b7 id ${s.id}`);

    if (this._pending) {
      const verdict = settle(this._pending, s, now);
      if (verdict.done) {
        const what = this._pending.command;
        this._pending = null;
        if (verdict.timedOut) {
          this._feedback(`No answer from the session to "${what}" yet.`, true);
        } else if (verdict.result && !verdict.result.ok) {
          this._feedback(verdict.result.error ?? `"${what}" failed`, true);
        } else if (what === 'lr' && verdict.result) {
          // confirmed by the session: say so, the heartbeat's lr changes only at the next step
          this._feedback(`Learning rate ${formatLr(verdict.result.value ?? null)} from the next step.`, false);
        } else {
          this._feedback('', false);
        }
      }
    }
    this._renderControls(now);
  }

  private _renderControls(now: number): void {
    const ended = isEnded(this._session);
    const c = ended ? { pause: false, resume: false, stop: false, lr: false } : controlsFor(this._session.state);
    const busy = this._pending !== null;
    setText(this._n.pending, busy ? PENDING_LABELS[this._pending!.command] : '');
    const n = this._n;
    n.pause.hidden = !c.pause && c.resume;
    n.resume.hidden = !c.resume;
    (n.pause as HTMLButtonElement).disabled = busy || !c.pause;
    (n.resume as HTMLButtonElement).disabled = busy || !c.resume;
    (n.stop as HTMLButtonElement).disabled = busy || !c.stop;
    (n.lrSet as HTMLButtonElement).disabled = busy || !c.lr;
    this._lrInput.disabled = !c.lr;
    // a run that ended has nothing to steer: only Dismiss
    n.pause.hidden = n.pause.hidden || ended;
    n.stop.hidden = ended;
    // (the lr box is display: inline-flex, which the hidden attribute does not override)
    (n.lrSet.parentElement as HTMLElement).style.display = ended ? 'none' : '';
    n.dismiss.hidden = !ended || !this._actions.dismiss;
    if (this._stopArmed !== null && now - this._stopArmed > STOP_CONFIRM_MS) {
      this._stopArmed = null;
    }
    setText(n.stop, this._stopArmed !== null ? 'Confirm stop' : 'Stop');
    n.stop.classList.toggle('mtnb-armed', this._stopArmed !== null);
    this._lrInput.placeholder = `lr ${formatLr(this._session.lr)}`;
  }

  private _onStop(): void {
    if (this._stopArmed === null) {
      // a second click within a few seconds confirms: a run is not stopped by a stray click
      this._stopArmed = Date.now();
      this._renderControls(Date.now());
      setTimeout(() => this._renderControls(Date.now()), STOP_CONFIRM_MS + 50);
      return;
    }
    this._stopArmed = null;
    void this._send('stop');
  }

  private _onSetLr(): void {
    const parsed = parseLearningRate(this._lrInput.value);
    if (!parsed.ok) {
      this._lrInput.classList.add('mtnb-invalid');
      this._feedback(parsed.error, true);
      return;
    }
    void this._send('lr', parsed.value).then(ok => {
      if (ok) {
        this._lrInput.value = '';
      }
    });
  }

  private _onDismiss(): void {
    if (!this._actions.dismiss) {
      return;
    }
    (this._n.dismiss as HTMLButtonElement).disabled = true;
    this._actions.dismiss(this._session.id).catch(err => {
      (this._n.dismiss as HTMLButtonElement).disabled = false;
      this._feedback(err instanceof Error ? err.message : String(err), true);
    });
  }

  private async _send(command: 'pause' | 'resume' | 'stop' | 'lr', value: number | null = null): Promise<boolean> {
    const pending: IPending = { command, id: null, since: Date.now() };
    this._pending = pending;
    this._feedback('', false);
    this._renderControls(Date.now());
    try {
      const reply = await this._actions.send(this._session.id, makeCommand(command, value));
      pending.id = reply.id;
      return true;
    } catch (err) {
      if (this._pending === pending) {
        this._pending = null;
      }
      this._feedback(err instanceof Error ? err.message : String(err), true);
      this._renderControls(Date.now());
      return false;
    }
  }

  private _feedback(text: string, isError: boolean): void {
    setText(this._n.feedback, text);
    this._n.feedback.classList.toggle('mtnb-feedback-error', isError && !!text);
    this._n.feedback.classList.toggle('mtnb-feedback-ok', !isError && !!text);
  }

  dispose(): void {
    this.node.remove();
  }
}
