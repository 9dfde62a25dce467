/** The loss sparkline: an SVG path over the last losses. Pure function. */

export interface ISparkline {
  /** SVG path data ("" when there is nothing to draw). */
  d: string;
  min: number | null;
  max: number | null;
  /** Coordinates of the last point, for a marker. */
  last: [number, number] | null;
}

/**
 * Scale ``values`` into a ``width`` x ``height`` box (y grows downwards, higher loss
 * higher up), leaving ``pad`` pixels at the edges. Missing values (null, NaN) break the
 * line into segments; a flat series is drawn through the middle; one point is a dot.
 */
export function sparkline(
  values: ReadonlyArray<number | null | undefined>,
  width: number,
  height: number,
  pad = 1
): ISparkline {
  const finite = values.filter((v): v is number => typeof v === 'number' && Number.isFinite(v));
  if (finite.length === 0 || width <= 2 * pad || height <= 2 * pad) {
    return { d: '', min: null, max: null, last: null };
  }
  const min = Math.min(...finite);
  const max = Math.max(...finite);
  const w = width - 2 * pad;
  const h = height - 2 * pad;
  const n = values.length;
  const x = (i: number) => pad + (n === 1 ? w / 2 : (i * w) / (n - 1));
  const y = (v: number) => (max === min ? pad + h / 2 : pad + ((max - v) * h) / (max - min));
  const r = (v: number) => Math.round(v * 100) / 100;

  const parts: string[] = [];
  let penDown = false;
  let last: [number, number] | null = null;
  values.forEach((v, i) => {
    if (typeof v !== 'number' || !Number.isFinite(v)) {
      penDown = false;
      return;
    }
    const px = r(x(i));
    const py = r(y(v));
    parts.push(`${penDown ? 'L' : 'M'}${px} ${py}`);
    penDown = true;
    last = [px, py];
  });
  let d = parts.join(' ');
  if (finite.length === 1 && last) {
    // a lone point: a zero-length segment that a round line cap renders as a dot
    d = `M${last[0]} ${last[1]} h0.01`;
  }
  return { d, min, max, last };
}
