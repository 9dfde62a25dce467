/** The sidebar: a Lumino widget hosting the session list view. */

import { Widget } from '@lumino/widgets';

import { SessionStore } from './store';
import { SessionListView } from './view';

export class SessionsPanel extends Widget {
  private _view: SessionListView;

  /**
   * @param activeId - the id of the active notebook's session, highlighted in the list
   * @param openNotebook - opens a notebook by path (a card's notebook link)
   */
  constructor(
    private _store: SessionStore,
    private _activeId: () => string | null = () => null,
    openNotebook?: (path: string) => void
  ) {
    super();
    this.id = 'megatrain-nb-sessions';
    this.addClass('mtnb-sidebar');
    this.title.caption = 'MegaTrain training sessions';
    this._view = new SessionListView({
      send: (id, request) => this._store.send(id, request),
      dismiss: id => this._store.dismiss(id),
      openNotebook
    });
    this.node.appendChild(this._view.node);
    this._store.changed.connect(this.refresh, this);
    this.refresh();
  }

  refresh(): void {
    this._view.update({
      sessions: this._store.sessions,
      error: this._store.error,
      activeId: this._activeId()
    });
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._store.changed.disconnect(this.refresh, this);
    this._view.dispose();
    super.dispose();
  }
}
