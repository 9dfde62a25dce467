/**
 * Requests to the server extension (megatrain_nb.lab.handlers) through JupyterLab's
 * ServerConnection, which adds the token / XSRF header exactly as for Jupyter's own APIs.
 */

import { URLExt } from '@jupyterlab/coreutils';
import { ServerConnection } from '@jupyterlab/services';

import { ICommandRequest } from './commands';
import { ISessionList } from './model';

export const ROUTE = 'megatrain-nb';

export class ApiError extends Error {
  constructor(
    message: string,
    readonly status: number
  ) {
    super(message);
  }
}

async function request<T>(
  settings: ServerConnection.ISettings,
  parts: string[],
  init: RequestInit = {}
): Promise<T> {
  const url = URLExt.join(settings.baseUrl, ROUTE, ...parts.map(encodeURIComponent));
  let response: Response;
  try {
    response = await ServerConnection.makeRequest(url, init, settings);
  } catch (error) {
    throw new ServerConnection.NetworkError(error as TypeError);
  }
  const text = await response.text();
  let data: any = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!response.ok) {
    const message =
      response.status === 404 && parts.length === 1
        ? 'The megatrain_nb server extension is not enabled on this Jupyter server ' +
          '(pip install "megatrain-nb[lab]" and restart JupyterLab).'
        : (data?.message ?? `${response.status} ${response.statusText}`);
    throw new ApiError(message, response.status);
  }
  return data as T;
}

export function fetchSessions(settings: ServerConnection.ISettings): Promise<ISessionList> {
  return request<ISessionList>(settings, ['sessions']);
}

export function sendCommand(
  settings: ServerConnection.ISettings,
  sessionId: string,
  body: ICommandRequest
): Promise<{ id: string }> {
  return request<{ id: string }>(settings, ['sessions', sessionId, 'command'], {
    method: 'POST',
    body: JSON.stringify(body)
  });
}

/** Remove a run that ended from the list (the card's Dismiss). */
export async function dismissSession(
  settings: ServerConnection.ISettings,
  sessionId: string
): Promise<void> {
  await request<null>(settings, ['sessions', sessionId], { method: 'DELETE' });
}
