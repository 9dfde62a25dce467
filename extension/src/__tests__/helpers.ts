import { ISessionInfo } from '../model';

export function session(over: Partial<ISessionInfo> = {}): ISessionInfo {
  return {
    id: 'abc123',
    name: 'tiny-gpt',
    pid: 4242,
    host: 'box',
    kernel_id: 'k-1',
    notebook: 'notebooks/01-quickstart.ipynb',
    state: 'running',
    step: 12,
    total_steps: 100,
    loss: 2.3456,
    lr: 3e-4,
    tokens_per_s: 1234.5,
    loss_tail: [3, 2.8, 2.5, 2.3456],
    memory: {
      device: { used_bytes: 2 * 2 ** 30, peak_bytes: 3 * 2 ** 30, capacity_bytes: 16 * 2 ** 30 },
      host: { used_bytes: 5 * 2 ** 30, peak_bytes: null, capacity_bytes: null },
      disk: { used_bytes: 0, peak_bytes: 0, capacity_bytes: 2 ** 40 }
    },
    last_command: null,
    started: 1000,
    updated: 2000,
    age: 0.3,
    ...over
  };
}
