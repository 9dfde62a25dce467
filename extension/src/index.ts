/**
 * megatrain-nb-lab: every megatrain_nb training session running on this Jupyter server,
 * in a sidebar (state, progress, loss sparkline, memory tiers; pause/resume, stop, learning
 * rate) and in the status bar (count, and the active notebook's run).
 */

import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { INotebookTracker } from '@jupyterlab/notebook';
import { IStatusBar } from '@jupyterlab/statusbar';
import { LabIcon } from '@jupyterlab/ui-components';

import { sessionForNotebook } from './model';
import { SessionsPanel } from './panel';
import { StatusItem } from './statusbar';
import { SessionStore } from './store';

export const PLUGIN_ID = 'megatrain-nb-lab:plugin';
export const OPEN_COMMAND = 'megatrain-nb:open-sessions';

const trainIcon = new LabIcon({
  name: 'megatrain-nb:train',
  svgstr:
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24" width="16" height="16">' +
    '<path class="jp-icon3" fill="#616161" d="M3 3h2v16h16v2H3z"/>' +
    '<path class="jp-icon3" fill="none" stroke="#616161" stroke-width="2" ' +
    'd="M6 6c3 0 4 9 7 9s3-4 7-5"/></svg>'
});

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'Show and control the megatrain_nb training sessions running on this server.',
  autoStart: true,
  optional: [IStatusBar, INotebookTracker, ILayoutRestorer, ILabShell],
  activate: (
    app: JupyterFrontEnd,
    statusBar: IStatusBar | null,
    tracker: INotebookTracker | null,
    restorer: ILayoutRestorer | null
  ) => {
    const store = new SessionStore(app.serviceManager.serverSettings);

    const activeSession = () => {
      const nb = tracker?.currentWidget ?? null;
      return sessionForNotebook(
        store.sessions,
        nb?.sessionContext.session?.kernel?.id ?? null,
        nb?.context.path ?? null
      );
    };

    const panel = new SessionsPanel(
      store,
      () => activeSession()?.id ?? null,
      path => void app.commands.execute('docmanager:open', { path })
    );
    panel.title.icon = trainIcon;
    app.shell.add(panel, 'left', { rank: 650 });
    restorer?.add(panel, panel.id);

    app.commands.addCommand(OPEN_COMMAND, {
      label: 'Show MegaTrain Training Sessions',
      caption: 'Open the sidebar listing the running megatrain_nb sessions',
      icon: trainIcon,
      execute: () => app.shell.activateById(panel.id)
    });

    if (statusBar) {
      const item = new StatusItem(() => void app.commands.execute(OPEN_COMMAND));
      statusBar.registerStatusItem('megatrain-nb-lab:status', { item, align: 'left', rank: 5 });
      const update = () => item.setSessions(store.sessions, activeSession());
      store.changed.connect(update);
      tracker?.currentChanged.connect(() => {
        update();
        panel.refresh();
      });
    }

    store.start();
    console.debug(`${PLUGIN_ID} activated`);
  }
};

export default plugin;
