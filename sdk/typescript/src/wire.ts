/**
 * snake_case on the wire, camelCase in TypeScript: objects of the API's
 * schemas are converted by the generated SCHEMAS table, so maps inside them
 * (`metadata`, an event's `payload`, a MIME bundle) keep their keys.
 */

import { SCHEMAS, type SchemaName } from './generated/openapi.js';

export const toCamel = (name: string): string => name.replace(/_([a-z0-9])/g, (_, c: string) => c.toUpperCase());
export const toSnake = (name: string): string => name.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`);

/** A wire object of `schema` as the SDK's camelCase object. */
export function fromWire<T>(schema: SchemaName, value: unknown): T {
  return convert(schema, value, 'in') as T;
}

/** The SDK's camelCase object of `schema` as its wire object. */
export function toWire(schema: SchemaName, value: unknown): Record<string, unknown> {
  return convert(schema, value, 'out') as Record<string, unknown>;
}

function convert(schema: SchemaName, value: unknown, direction: 'in' | 'out'): unknown {
  if (Array.isArray(value)) return value.map((item) => convert(schema, item, direction));
  if (value === null || typeof value !== 'object') return value;
  const properties = SCHEMAS[schema] ?? {};
  const out: Record<string, unknown> = {};
  for (const [key, item] of Object.entries(value)) {
    if (item === undefined) continue;
    const camel = direction === 'in' ? toCamel(key) : key;
    const shape = properties[camel];
    // Properties the document does not know yet are renamed, their values kept as they are.
    const name = direction === 'in' ? camel : (shape?.wire ?? toSnake(key));
    out[name] = shape?.ref ? convert(shape.ref, item, direction) : item;
  }
  return out;
}
