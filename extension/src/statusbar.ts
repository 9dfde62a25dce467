/** The status bar item: how many runs, and the active notebook's run at a glance. */

import { Widget } from '@lumino/widgets';

import { statusText } from './format';
import { ISessionInfo } from './model';

export class StatusItem extends Widget {
  constructor(onClick: () => void) {
    super();
    this.addClass('mtnb-status');
    this.node.dataset.testid = 'mtnb-status';
    this.node.title = 'MegaTrain sessions: click to open the sidebar';
    this.node.addEventListener('click', onClick);
    this.setSessions([], null);
  }

  setSessions(sessions: ISessionInfo[], active: ISessionInfo | null): void {
    const text = statusText(sessions, active);
    if (this.node.textContent !== text) {
      this.node.textContent = text;
    }
    this.node.dataset.state = active?.state ?? '';
  }
}
